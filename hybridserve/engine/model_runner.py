"""Loads the model and its caches, turns a step plan into tensors, runs it, samples.

The runner owns every tensor: weights, the paged KV cache, the recurrent-state slots and their snapshots. It
executes plain-data plans (plan.py) and keeps, per request id, only what later plans leave out: the block table
(plans send diffs) and the sampler state (penalties read the tokens sampled so far, a seeded request keeps its
generator across preemption)."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridserve.config import EngineConfig
from hybridserve.engine import decode_graphs, roofline
from hybridserve.engine.backend import choose_backend
from hybridserve.engine.cache.allocation import allocate_caches
from hybridserve.engine.plan import ScheduledRequest, SchedulerOutput
from hybridserve.engine.prompt_logprobs import PromptLogprobs
from hybridserve.engine.sampler import Sampler, SampleResult, SamplingState
from hybridserve.engine.structured_output import TokenMask
from hybridserve.models.base import CausalLM
from hybridserve.models.cache_specs import CacheLayout
from hybridserve.models.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    StateMetadata,
    decode_bias,
)
from hybridserve.models.loader.model import load_model
from hybridserve.models.registry import load_config

logger = logging.getLogger("hybridserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16 / AMX), else float32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def keep_freed_buffers() -> bool:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse rather than hand them back to the kernel.
    By default it maps each block over its threshold (128 KiB, raised as such blocks are freed) afresh and unmaps
    it when freed, and trims the heap's free top above twice that, so a step's activations (a few MiB each) keep
    coming back as fresh pages, faulted in one at a time while the step's other threads wait: 10-60 thousand
    faults over 37 steps at batch 64, the decode step 3-4% slower (docs/benchmarks.md). The next step allocates
    the same buffers, so keeping them adds little to the peak (the heap keeps at most 256 MiB free at its top).
    Returns False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 * 1024**2) and libc.mallopt(m_trim_threshold, 256 * 1024**2))


class ModelRunner:
    """Start-up, in order: the device and dtype, the backend (backend.py), the model (loader/model.py), its
    linear layers packed for the backend, the caches (cache/allocation.py), the backend's kernels, CUDA graphs."""

    def __init__(self, config: EngineConfig, hf_dir: Path) -> None:
        self.device = choose_device(config.model.device)
        self.dtype = choose_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.backend = choose_backend(self.device, self.dtype, config.kernels)
        self.hf_config = load_config(hf_dir)
        self.model = self._load_model(hf_dir)
        self.vocab_size = self.hf_config.vocab_size
        self.max_position = self._max_position()
        self.layout = CacheLayout(self.model.cache_spec(self.block_size, self.dtype))
        self.num_blocks = config.cache.num_kv_blocks or self.layout.num_blocks_for(config.cache.kv_cache_memory_bytes)
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.cache.kv_cache_memory_bytes} is smaller than one KV block "
                f"({self.layout.bytes_per_block} bytes)"
            )
        graphs = self.backend.captures_decode_graphs(self.model, self.layout)
        slots = (config.cache.num_state_slots or config.scheduler.max_num_seqs) if self.layout.state_specs else 0
        # With decode graphs the cache has one block past the pool's, for the padding rows' writes.
        caches = allocate_caches(
            self.layout,
            self.num_blocks,
            config.cache,
            slots,
            self.device,
            padding_block=graphs,
            backups=config.scheduler.speculative_config is not None,
        )
        self.kv_caches, self.state_tensors = caches.kv_caches, caches.state_tensors
        self.num_state_slots, self.num_state_snapshots = slots, caches.num_state_snapshots
        self.backend.load_kernels(self.model, self.layout, self.hf_config)
        self.sampler = Sampler(self.vocab_size, self.backend.fused_ops)
        self.decode_graphs: decode_graphs.DecodeGraphs | None = None
        if graphs:
            max_len = min(config.model.max_model_len or self.max_position, self.max_position)
            self.decode_graphs = decode_graphs.DecodeGraphs(
                self.model,
                self.kv_caches,
                self.block_size,
                config.scheduler.max_num_seqs,
                -(-max_len // self.block_size),
                self.num_blocks,
                self.dtype,
                self.device,
            )
            logger.info("decode-only steps replay CUDA graphs, captured per padded shape as steps first need them")
        self.requests: dict[str, _RunnerRequest] = {}  # every request an earlier plan scheduled and none finished

    def _load_model(self, hf_dir: Path) -> CausalLM:
        """The model with its weights, its linear layers packed for the backend, in eval mode."""
        t0 = time.perf_counter()
        model = load_model(hf_dir, self.hf_config, self.dtype, self.device)
        self.costs = roofline.model_costs(model)  # before the linear layers are swapped for packed ones
        self.backend.prepare(model, hf_dir)
        logger.info("loaded %s (%s, %s) in %.1fs", hf_dir, self.device, self.dtype, time.perf_counter() - t0)
        # After loading, so the loader's transient buffers still go back to the kernel.
        if self.device.type == "cpu" and keep_freed_buffers():
            logger.info("malloc keeps freed buffers up to 32 MiB: steps reuse their activations' pages")
        return model.eval()

    def _max_position(self) -> int:
        """The longest context the model takes: its max_position_embeddings, or its sliding window if shorter."""
        max_position = self.hf_config.max_position_embeddings
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True) and window < max_position:
            # Attention here is full attention: within the window it equals sliding-window attention,
            # beyond it it would silently differ, so the context stops at the window.
            logger.warning("model uses sliding-window attention (%d tokens): context limited to %d", window, window)
            return window
        return max_position

    def weight_read_tokens(self) -> float:
        """What reading this model's weights once costs on this device, in tokens' compute: measured now
        (roofline.py, a fraction of a second), logged."""
        # A GPU's GEMM needs a larger square than a CPU's before launches stop mattering.
        cuda = self.device.type == "cuda"
        limits = roofline.measure(
            self.device, self.dtype, read_mib=1024 if cuda else 256, gemm_n=4096 if cuda else 1024
        )
        tokens = roofline.weight_read_tokens(self.costs, self.dtype.itemsize, limits)
        logger.info(
            "speculative decoding: a step's weight read costs %.1f tokens' compute (%.1f GB/s read, %.0f GFLOP/s "
            "GEMM in %s); drafts are sized against it",
            tokens,
            limits.read_gb_s,
            limits.gemm_gflop_s,
            self.dtype,
        )
        return tokens

    def check_integrity(self) -> None:
        if self.state_tensors is not None:
            self.state_tensors.check_integrity()

    def _apply_books(self, plan: SchedulerOutput) -> None:
        """Take in what the plan says of requests: those finished are forgotten, new ones met, tables grown."""
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            params = new.sampling_params
            outputs = list(new.output_token_ids)  # sampled elsewhere: a prefill worker's first token
            state = SamplingState.create(params, new.prompt_token_ids, outputs, new.eos_token_ids, self.device)
            state.skip_draws(len(outputs), self.vocab_size)
            # A remotely prefilled request's prompt logprobs came from its prefill worker.
            wanted = params.prompt_logprobs is not None and not outputs
            prompt = PromptLogprobs(new.prompt_token_ids, params.prompt_logprobs) if wanted else None
            self.requests[new.request_id] = _RunnerRequest([], state, prompt, len(new.prompt_token_ids))
        for s in plan.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:
                raise RuntimeError(f"the plan schedules request {s.request_id!r}, which no plan introduced")
            if s.full_table:
                req.block_ids = list(s.block_ids)
            else:
                req.block_ids.extend(s.block_ids)

    def attention_metadata(self, plan: SchedulerOutput) -> AttentionMetadata:
        """Cache slots, the decode group and the prefill chunks of a step, built once for every layer; for
        models with linear attention, the recurrent-state slots of each group."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_states: list[int] = []
        prefill_states: list[int] = []
        offset = 0
        native_prefill = self.backend.attention is not None and self.backend.attention.prefills
        for s in plan.scheduled:
            req = self.requests[s.request_id]
            table = req.block_ids
            start, n = s.start, s.num_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            # The native prefill kernel takes every prompt token, a chunk's last one too: a prompt then gets the
            # same bits whole, in chunks or after a prefix hit. Decode attention sums in another order.
            if n == 1 and not (native_prefill and start < req.prompt_len):
                decode_states.append(s.state_slot)
                decode_rows.append(offset)
                decode_tables.append(_blocks(table, start + 1, bs))
                decode_lens.append(start + 1)
            elif s.num_draft and self.state_tensors is None:
                # A decode with drafts: a decode row per position, each seeing the keys up to its own (the step
                # writes every key first). With recurrent state it is a chunk instead: a slot per decode row.
                for p in range(start, start + n):
                    decode_rows.append(offset + p - start)
                    decode_tables.append(_blocks(table, p + 1, bs))
                    decode_lens.append(p + 1)
            elif native_prefill:  # the kernel reads every key from the cache and masks by position itself
                prefill_states.append(s.state_slot)
                used = _blocks(table, start + n, bs)
                prefills.append(PrefillChunk(offset, offset + n, start, torch.tensor(used, device=dev), None))
            elif start == 0:
                prefill_states.append(s.state_slot)
                prefills.append(PrefillChunk(offset, offset + n, 0, None, None))
            else:
                prefill_states.append(s.state_slot)
                length = start + n
                used = _blocks(table, length, bs)
                q_pos = torch.arange(start, length, device=dev).unsqueeze(1)
                mask = torch.arange(length, device=dev).unsqueeze(0) <= q_pos
                prefills.append(
                    PrefillChunk(offset, offset + n, start, torch.tensor(used, device=dev), mask.view(1, 1, n, length))
                )
            offset += n
        decode = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            bias = None  # the native kernel stops at each request's length by itself
            if self.backend.attention is None:
                bias = decode_bias(lens, torch.arange(width * bs, device=dev), self.dtype)
            decode = DecodeGroup(torch.tensor(decode_rows, device=dev), tables, tables.flatten(), lens, bias)
        states = None
        if self.state_tensors is not None:
            decode_slots = torch.tensor(decode_states, device=dev) if decode_states else None
            states = StateMetadata(decode_slots, prefill_states, self.backend.state_kernel)
        return AttentionMetadata(torch.tensor(slots, device=dev), decode, prefills, states, self.backend.attention)

    def _graph_inputs(self, plan: SchedulerOutput) -> tuple[list[int], list[list[int]], list[int]] | None:
        """Cache slots, block tables and context lengths of a decode-only plan (one token a request, no drafts),
        as attention_metadata gives them to the eager step; None for any other plan."""
        bs = self.block_size
        slots: list[int] = []
        tables: list[list[int]] = []
        lens: list[int] = []
        for s in plan.scheduled:
            if s.num_tokens != 1 or s.num_draft:
                return None
            table = self.requests[s.request_id].block_ids
            slots.append(table[s.start // bs] * bs + s.start % bs)
            tables.append(_blocks(table, s.start + 1, bs))
            lens.append(s.start + 1)
        return slots, tables, lens

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Execute a plan up to the hidden states: its books and state operations, then the model over every
        scheduled token (in plan order). Returns [plan.num_tokens, hidden] (no rows for a plan without tokens)."""
        self._apply_books(plan)
        states = self.state_tensors
        if states is not None:
            for slot in plan.zero_slots:
                states.zero(slot)
            for snapshot, slot in plan.restore_snapshots:
                states.restore(snapshot, slot)
            for s in plan.scheduled:
                if s.num_draft:  # the state before the draft, to go back to if it is rejected
                    states.back_up(s.state_slot)
        elif plan.zero_slots or plan.restore_snapshots or plan.save_snapshots:
            raise RuntimeError("the plan has recurrent-state operations but this model keeps no recurrent state")
        ids: list[int] = []
        positions: list[int] = []
        for s in plan.scheduled:
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + s.num_tokens))
        hidden = None
        if ids and self.decode_graphs is not None and (inputs := self._graph_inputs(plan)) is not None:
            hidden = self.decode_graphs.run(ids, positions, *inputs)  # None once a capture has failed
        if hidden is None and ids:
            meta = self.attention_metadata(plan)
            hidden = self.model(
                torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
                self.kv_caches,
                meta,
            )
        elif hidden is None:
            hidden = torch.empty(0, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        if states is not None:
            for slot, snapshot in plan.save_snapshots:
                states.save(slot, snapshot)
        return hidden

    @torch.inference_mode()
    def sample(
        self, plan: SchedulerOutput, hidden: torch.Tensor, mask: TokenMask | None = None
    ) -> dict[str, SampleResult]:
        """The next token of every request that samples in `plan`, from the hidden states `forward` returned;
        `mask` limits the constrained rows (rows in the order of plan.sampling_ids) to their grammar. A request
        that asked for prompt logprobs gets them with its first token. A request with draft tokens is sampled at
        each of their positions too, and its result carries the drafts the sampler accepted."""
        rows: list[int] = []
        drafts: dict[str, list[int]] = {}
        offset = 0
        for s in plan.scheduled:
            prompt = self.requests[s.request_id].prompt_logprobs
            if prompt is not None and (picked := prompt.rows(s.start, s.num_tokens)):
                chunk = hidden[offset + picked.start : offset + picked.stop]
                prompt.add(chunk, s.start + picked.start, self.model.compute_logits, self.vocab_size)
            offset += s.num_tokens
            if s.samples:
                rows.extend(range(offset - 1 - s.num_draft, offset))
                if s.num_draft:
                    drafts[s.request_id] = s.token_ids[-s.num_draft :]
        if not rows:
            return {}
        ids = plan.sampling_ids
        requests = [self.requests[rid] for rid in ids]
        states = [req.sampling for req in requests]
        sampled_hidden = hidden[torch.tensor(rows, device=self.device)]
        greedy = None
        if not drafts and mask is None and self.sampler.plain_greedy(states):
            greedy = self.model.greedy_tokens(sampled_hidden, self.vocab_size)
        if greedy is not None:
            results = [SampleResult(t, None) for t in greedy.tolist()]
        elif drafts:
            logits = self.model.compute_logits(sampled_hidden)
            results = self.sampler.verify(logits, states, [drafts.get(rid, []) for rid in ids], mask)
        else:
            results = self.sampler(self.model.compute_logits(sampled_hidden), states, mask)
        for i, (req, result) in enumerate(zip(requests, results, strict=True)):
            if result.accepted:
                req.sampling.output_token_ids.extend(a.token_id for a in result.accepted)
            req.sampling.output_token_ids.append(result.token_id)
            if req.prompt_logprobs is not None and (taken := req.prompt_logprobs.take()) is not None:
                results[i] = dataclasses.replace(result, prompt_logprobs=taken)
        sampled = dict(zip(ids, results, strict=True))
        if drafts and self.state_tensors is not None:
            self._roll_back_rejected(plan, sampled)
        return sampled

    def _roll_back_rejected(self, plan: SchedulerOutput, sampled: dict[str, SampleResult]) -> None:
        """Recurrent state went through every draft token: where some were rejected, the state goes back to
        its backup and the tokens kept (the last known one and the drafts accepted) are run again, so the state
        is that after them alone. Their KV is written again, the same; the hidden states are not needed."""
        assert self.state_tensors is not None
        again: list[ScheduledRequest] = []
        for s in plan.scheduled:
            kept = len(sampled[s.request_id].accepted) if s.num_draft else 0
            if kept < s.num_draft:
                self.state_tensors.roll_back(s.state_slot)
                again.append(
                    ScheduledRequest(s.request_id, s.start, s.token_ids[: kept + 1], [], False, False, s.state_slot)
                )
        if again:
            self.forward(SchedulerOutput(again))


def _blocks(table: list[int], length: int, block_size: int) -> list[int]:
    """The blocks of `table` that hold a request's first `length` tokens."""
    return table[: -(-length // block_size)]


@dataclass(eq=False)
class _RunnerRequest:
    """What the runner keeps of a request between plans."""

    block_ids: list[int]
    sampling: SamplingState
    prompt_logprobs: PromptLogprobs | None  # the request asked for them
    prompt_len: int
