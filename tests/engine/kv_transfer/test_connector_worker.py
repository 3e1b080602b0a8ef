"""The KV connector's worker half on its own: two of them in this process, over small caches (an attention layer's
blocks and a linear-attention layer's state slots), with real NIXL agents on loopback and no engine. The orders
are the scheduler half's; what comes back is what happened to the bytes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from hybridserve.config import TransferConfig
from hybridserve.engine.kv_transfer.connector_worker import ConnectorWorker
from hybridserve.engine.kv_transfer.messages import PullOrder, TransferEvents, TransferOrders, TransferSource
from hybridserve.engine.protocol import EngineCoreOutput
from hybridserve.models.cache_specs import AttentionSpec, CacheLayout, LinearStateSpec

pytest.importorskip("nixl._api")

TIMEOUT_S = 20.0
NUM_BLOCKS, NUM_SLOTS = 12, 3


def _layout(block_size: int = 4) -> CacheLayout:
    return CacheLayout((AttentionSpec(block_size, 2, 8, torch.float32), LinearStateSpec(2, 4, 6, 4, torch.float32)))


_CACHES: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # by agent: kv, conv, state


def _worker(role: str, seed: int, block_size: int = 4, **settings: object) -> ConnectorWorker:
    layout = _layout(block_size)
    attention, linear = layout.layer_specs
    assert isinstance(attention, AttentionSpec) and isinstance(linear, LinearStateSpec)
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(attention.shape(NUM_BLOCKS), generator=g)
    conv = torch.randn(linear.conv_shape(NUM_SLOTS), generator=g)
    state = torch.randn(linear.state_shape(NUM_SLOTS), generator=g)
    config = TransferConfig(role=role, kv_staging_bytes=1 << 20, **settings)  # type: ignore[arg-type]
    worker = ConnectorWorker(config, layout, [kv, (conv, state)], torch.device("cpu"), "weights-1")
    _CACHES[worker.endpoint.agent] = (kv, conv, state)
    return worker


def _caches(worker: ConnectorWorker) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _CACHES[worker.endpoint.agent]


def _until(worker: ConnectorWorker, done: Callable[[TransferEvents], bool]) -> TransferEvents:
    """Polls `worker` until `done` holds for what it reported so far (bounded)."""
    seen = TransferEvents()
    deadline = time.monotonic() + TIMEOUT_S
    while not done(seen):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; reported so far: {seen}")
        events = worker.poll()
        for name in ("landed", "failed", "stuck", "freed", "heard"):
            getattr(seen, name).extend(getattr(events, name))
        time.sleep(0.01)
    return seen


@pytest.fixture(scope="module")
def pair() -> tuple[ConnectorWorker, ConnectorWorker]:
    prefill, decode = _worker("prefill", 1), _worker("decode", 2)
    assert decode.add_peer(prefill.endpoint)
    return prefill, decode


def test_a_held_requests_blocks_and_state_land_in_the_readers_and_its_prefill_worker_hears_done(
    pair: tuple[ConnectorWorker, ConnectorWorker],
) -> None:
    prefill, decode = pair
    held = TransferSource(prefill.endpoint.agent, "p1", [7, 3, 9], 1, 12, 0)
    outputs = [EngineCoreOutput("p1", [5], kv_transfer=held), EngineCoreOutput("other", [6])]
    prefill.stage(outputs)  # fragmented (runs of 1): packed into the arena, the output names the span
    source = outputs[0].kv_transfer
    assert source is not None and source.staged >= 0 and outputs[1].kv_transfer is None
    assert decode.execute(TransferOrders(pulls=[PullOrder("d1", source, [2, 5, 8], 0)])) == TransferEvents()
    assert decode.busy and decode.reading == {"d1"}
    assert _until(decode, lambda e: bool(e.landed)) == TransferEvents(landed=["d1"])
    (kv_p, conv_p, state_p), (kv_d, conv_d, state_d) = _caches(prefill), _caches(decode)
    for theirs, ours in zip(held.block_ids, [2, 5, 8], strict=True):
        assert torch.equal(kv_d[:, :, ours], kv_p[:, :, theirs])
    assert torch.equal(conv_d[0], conv_p[1]) and torch.equal(state_d[0], state_p[1])
    assert _until(prefill, lambda e: bool(e.heard)) == TransferEvents(heard=[("done", "p1")])
    counters = decode.counters
    assert (counters.pulls_done, counters.pulls_failed, counters.staged) == (1, 0, 1)  # unpacked from its own span
    assert counters.kv_bytes == 3 * 2 * 2 * 4 * 8 * 4 and counters.state_bytes == (6 * 3 + 2 * 4 * 4) * 4
    assert not decode.busy
    decode.check_integrity(held=set())
    prefill.check_integrity(held={"p1"})
    with pytest.raises(AssertionError, match=r"staging spans held for \['p1'\], neither held nor read"):
        prefill.check_integrity(held=set())
    prefill.execute(TransferOrders(releases=["p1"]))  # the scheduler half let it go
    prefill.check_integrity(held=set())


def test_a_dropped_read_is_cancelled_and_its_prefill_worker_told(
    pair: tuple[ConnectorWorker, ConnectorWorker],
) -> None:
    prefill, decode = pair
    source = TransferSource(prefill.endpoint.agent, "p2", [0, 1, 2, 3], 2, 16, 0)
    decode.execute(TransferOrders(pulls=[PullOrder("d2", source, [4, 5, 6, 7], 1)]))
    events = decode.execute(TransferOrders(drops=[("d2", source)]))
    if events.freed != ["d2"]:  # NIXL kept the read a while: it is freed at a later poll
        events = _until(decode, lambda e: bool(e.freed))
    assert events.freed == ["d2"] and not events.landed and not decode.busy
    assert _until(prefill, lambda e: bool(e.heard)).heard == [("drop", "p2")]
    decode.check_integrity(held=set())


def test_a_read_that_cannot_start_fails_and_frees_its_blocks(pair: tuple[ConnectorWorker, ConnectorWorker]) -> None:
    prefill, decode = pair
    beyond = TransferSource(prefill.endpoint.agent, "p3", [NUM_BLOCKS + 100], 0, 4, 0)  # outside its memory
    events = decode.execute(TransferOrders(pulls=[PullOrder("d3", beyond, [0], 0)]))
    assert [(rid, why.startswith(f"reading from {prefill.endpoint.agent} failed")) for rid, why in events.failed] == [
        ("d3", True)
    ]
    assert not events.stuck
    assert decode.counters.pulls_failed == 1 and not decode.busy
    assert _until(prefill, lambda e: bool(e.heard)).heard == [("drop", "p3")]


def test_a_peer_is_checked_once_and_its_problem_named() -> None:
    decode, odd = _worker("decode", 3), _worker("prefill", 4, block_size=8)
    unknown = TransferSource("nobody", "x", [0], -1, 4, 0)
    assert decode.check(unknown) == "prefill worker nobody is unknown here (the frontend did not introduce it)"
    assert not decode.add_peer(odd.endpoint) and not decode.add_peer(odd.endpoint)
    theirs = TransferSource(odd.endpoint.agent, "x", [0], -1, 4, 0)
    assert decode.check(theirs) == (
        f"prefill worker {odd.endpoint.agent} is incompatible with this decode worker: block_size 8 != 4"
    )
