"""The frontend's two-phase flow over a prefill pool and a decode pool (disaggregated prefill and decode).

A new request goes first to a prefill worker as a RemoteDecode request: it prefills, samples the first token
(which streams to the client at once) and holds the KV and state, returning where they wait. The frontend then
hands the request, with that `TransferSource` and the first token, to the decode worker chosen up front; it
reads the KV and state over NIXL and decodes from there. Before its first such request a decode worker is told
of the prefill worker (`AddTransferPeer`), and checks it.

Conditional disaggregation: when the part of the prompt the chosen decode worker does not hold is at most
`max_local_prefill_tokens`, the decode worker prefills it itself, and the transfer would cost more than it saves.
With one pool down, the other serves aggregated, so a deployment degrades rather than stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from hybridserve.engine.kv_transfer.messages import AddTransferPeer, RemoteDecode, RemotePrefill
from hybridserve.engine.protocol import AddRequest, EngineCoreOutput, EngineCoreRequest, EngineInput
from hybridserve.router.link import WorkerLink, WorkerState

# Picks a worker among some for a prompt: (the worker, the prompt blocks it holds).
Pick = Callable[[list[WorkerLink], list[int]], tuple[WorkerLink, int]]


@dataclass
class _Handoff:
    request: EngineCoreRequest
    decode: WorkerLink  # chosen with the prefill worker; another decode worker if it went down meanwhile


class Disaggregation:
    def __init__(self, links: list[WorkerLink], block_size: int, max_local_prefill_tokens: int) -> None:
        self.links = links
        self.block_size = block_size
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.pending: dict[str, _Handoff] = {}  # requests in their prefill phase

    def _up(self, role: str) -> list[WorkerLink]:
        return [w for w in self.links if w.role == role and w.state is WorkerState.UP]

    def route(self, requests: list[EngineCoreRequest], pick: Pick) -> tuple[WorkerLink, list[EngineCoreRequest]]:
        """Where the requests (the choices of one) go first, and as what."""
        prompt = requests[0].prompt_token_ids
        prefill, decode = self._up("prefill"), self._up("decode")
        if not prefill or not decode:
            return pick(prefill or decode, prompt)[0], requests
        target, held = pick(decode, prompt)
        if len(prompt) - held * self.block_size <= self.max_local_prefill_tokens:
            return target, requests
        for request in requests:
            self.pending[request.request_id] = _Handoff(request, target)
        source = pick(prefill, prompt)[0]
        return source, [msgspec.structs.replace(r, kv_transfer=RemoteDecode()) for r in requests]

    def hand_off(self, prefill: WorkerLink, out: EngineCoreOutput, pick: Pick) -> tuple[WorkerLink, list[EngineInput]]:
        """The decode worker for a request its prefill worker finished with, and what to send it. Raises
        LookupError when no decode worker is up."""
        assert out.kv_transfer is not None and prefill.transfer is not None
        handoff = self.pending.pop(out.request_id)
        target = handoff.decode
        if target.state is not WorkerState.UP:
            decode = self._up("decode")
            if not decode:
                raise LookupError("no decode worker is up to take the prefilled request")
            target = pick(decode, handoff.request.prompt_token_ids)[0]
        messages: list[EngineInput] = []
        if prefill.transfer.agent not in target.introduced:
            messages.append(AddTransferPeer(prefill.transfer))
            target.introduced.add(prefill.transfer.agent)
        transfer = RemotePrefill(out.kv_transfer, out.new_token_ids[0])
        messages.append(AddRequest(msgspec.structs.replace(handoff.request, kv_transfer=transfer)))
        return target, messages
