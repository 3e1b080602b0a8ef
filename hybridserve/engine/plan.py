"""One engine step as plain data: what the scheduler decided, for the model runner to execute.

The plan is self-contained and serialisable (msgspec), so what runs it may live elsewhere: tensor-parallel
ranks receive the same plan, and a KV connector reads the block ids in it. The runner never sees a
`Request`: from earlier plans it keeps, per request id, the block table and the sampler state, and it forgets
both once the id is listed in `finished_ids`. Block tables travel as diffs: in full the first time a request
is scheduled and when it resumes after preemption (`full_table`), as the blocks added since otherwise.

State operations are on slots of the recurrent-state pool and of its snapshot pool (models with
linear-attention layers): before the step a slot is zeroed or overwritten by a snapshot (never both), and after
the step slots are copied into snapshots. A snapshot saved after this step is findable only from the next plan on.

Disaggregation: the KV connector's scheduler half decides which reads start, which are dropped and which held
requests are let go; those orders ride in the plan to its worker half, which moves the bytes before the step runs.

With speculative decoding a decoding request's entry carries draft tokens after its last known token; the runner
samples at every one of those positions and the scheduler keeps the run the sampler accepted.
"""

from __future__ import annotations

import msgspec

from hybridserve.engine.kv_transfer.messages import TransferOrders
from hybridserve.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, frozen=True, array_like=True):
    """What the runner's sampler needs for a request's whole life; sent the first time it is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]  # the ids that end it (none under ignore_eos); with min_tokens, masked until then
    output_token_ids: list[int] = []  # sampled before it came here: the first token of a remotely prefilled one


class ScheduledRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    start: int  # tokens of this request already in the cache: the position of token_ids[0]
    token_ids: list[int]  # the tokens to compute this step, at positions start, start + 1, ...
    block_ids: list[int]  # the request's whole block table if full_table, else the blocks appended to it
    full_table: bool
    samples: bool  # the step computes the last known token: a new token is sampled from its logits
    state_slot: int = -1  # models with linear-attention layers: the request's recurrent-state slot
    # Speculative decoding: the last num_draft of token_ids are proposed, not known; the step scores each
    # position, and the sampler keeps the proposals that match what it samples there.
    num_draft: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SchedulerOutput(msgspec.Struct, frozen=True, array_like=True):
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequest] = []
    finished_ids: list[str] = []  # requests ended since the last plan: the runner drops what it keeps of them
    zero_slots: list[int] = []  # state slots to zero before the step
    restore_snapshots: list[tuple[int, int]] = []  # (snapshot, slot): copied before the step
    save_snapshots: list[tuple[int, int]] = []  # (slot, snapshot): copied after the step
    kv_transfer: TransferOrders | None = None  # disaggregation: the KV connector's decisions, for its worker half

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def sampling_ids(self) -> list[str]:
        """The requests that sample this step, in the order of their rows in the sampler."""
        return [s.request_id for s in self.scheduled if s.samples]
