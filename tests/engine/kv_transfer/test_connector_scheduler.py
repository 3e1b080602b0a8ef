"""The KV connector's scheduler half on its own: no engine, no NIXL, a clock the test moves. It decides which
reads start (bounded by the bytes in flight), what a failed or stuck read becomes, which held requests are let go
(their readers done, dropped, or their leases out) and when queued readers keep their leases; the decisions come
out as orders for the worker half."""

from __future__ import annotations

import pytest

from hybridserve.config import TransferConfig
from hybridserve.engine.kv_transfer.connector_scheduler import ConnectorScheduler
from hybridserve.engine.kv_transfer.messages import (
    PullOrder,
    RemoteDecode,
    RemotePrefill,
    TransferOrders,
    TransferSource,
)
from hybridserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from hybridserve.engine.request import Request
from hybridserve.sampling_params import SamplingParams

BLOCK_BYTES, STATE_BYTES = 1000, 500
PARAMS = SamplingParams(max_tokens=4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _half(clock: Clock, **settings: object) -> ConnectorScheduler:
    config = TransferConfig(**{"role": "decode", "kv_lease": 3.0, **settings})  # type: ignore[arg-type]
    return ConnectorScheduler(config, "us", BLOCK_BYTES, STATE_BYTES, clock)


def _source(handle: str, blocks: int, agent: str = "them") -> TransferSource:
    return TransferSource(agent, handle, list(range(blocks)), 2, blocks * 16, 0)


def _reader(rid: str, blocks: int, agent: str = "them") -> Request:
    transfer = RemotePrefill(_source("their-" + rid, blocks, agent), first_token=7)
    return Request(EngineCoreRequest(rid, [1] * blocks * 16, PARAMS, [], 0.0, kv_transfer=transfer), 4096)


def _prefilled(rid: str) -> Request:
    req = Request(EngineCoreRequest(rid, list(range(40)), PARAMS, [], 0.0, kv_transfer=RemoteDecode()), 4096)
    req.num_cached_tokens = 16
    return req


def test_reads_start_while_the_bytes_in_flight_leave_room_and_one_always_does() -> None:
    half = _half(Clock(), kv_transfer_max_bytes=5000)
    big, small, next_ = _reader("big", 9), _reader("small", 3), _reader("next", 1)
    assert half.has_room(big)  # 9.5 kB > 5 kB, but nothing is in flight
    half.pull(big, [10, 11, 12, 13, 14, 15, 16, 17, 18], 0)
    assert not half.has_room(next_)
    assert half.landed("big") is big
    assert half.has_room(small)
    half.pull(small, [4, 5, 6], 1)  # 3.5 kB
    assert half.has_room(next_)  # 3.5 + 1.5 kB
    half.pull(next_, [7], 0)
    assert not half.has_room(_reader("more", 1))
    orders = half.take_orders()
    assert orders.pulls == [
        PullOrder("big", big.pull_from, [10, 11, 12, 13, 14, 15, 16, 17, 18], 0),  # type: ignore[arg-type]
        PullOrder("small", small.pull_from, [4, 5, 6], 1),  # type: ignore[arg-type]
        PullOrder("next", next_.pull_from, [7], 0),  # type: ignore[arg-type]
    ]
    assert not half.take_orders()  # taken once
    assert sorted(half.pulling) == ["next", "small"]
    half.check_integrity()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_read_fails_its_request_or_hands_it_back_to_prefill_here(policy: str) -> None:
    half = _half(Clock(), kv_transfer_failure=policy)
    req = _reader("r", 2)
    half.pull(req, [5, 6], 3)
    half.take_orders()
    got, error = half.failed("r", "NIXL reported an error")
    assert got is req
    assert error == (
        None if policy == "recompute" else "KV transfer from prefill worker them failed: NIXL reported an error"
    )
    assert "r" in half.pulling  # the scheduler decides what it becomes, then forgets it here
    half.forget("r")
    assert not half.pulling and not half.busy
    half.check_integrity()


def test_a_stuck_read_ends_for_its_client_and_keeps_its_blocks_until_freed() -> None:
    half = _half(Clock())
    req = _reader("r", 2)
    half.pull(req, [5, 6], 3)
    half.take_orders()
    out = half.stuck("r", "no data from it within 2s (deadline)")
    error = "KV transfer from prefill worker them failed: no data from it within 2s (deadline)"
    assert out == EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR, error=error)
    assert "r" in half.pulling and half.busy
    assert half.has_room(_reader("x", 1))  # a stuck read no longer counts against the bytes in flight
    assert half.drop(req) is False  # its client heard already: an abort changes nothing
    assert not half.take_orders()
    half.check_integrity()
    half.forget("r")  # the worker half reported it freed
    half.check_integrity()


def test_dropping_a_reader_tells_its_prefill_worker_whatever_its_state() -> None:
    half = _half(Clock())
    waiting, pulling = _reader("waiting", 1), _reader("pulling", 2)
    half.pull(pulling, [1, 2], 0)
    half.take_orders()
    assert half.drop(waiting) and half.drop(pulling)
    assert half.take_orders() == TransferOrders(
        drops=[("waiting", waiting.pull_from), ("pulling", pulling.pull_from)]  # type: ignore[list-item]
    )
    assert "pulling" in half.pulling  # until the worker half reports its read cancelled
    half.check_integrity()


def test_a_held_request_is_let_go_when_its_reader_is_done_or_its_lease_runs_out() -> None:
    clock = Clock()
    half = _half(clock, role="prefill")
    a, b, c = _prefilled("a"), _prefilled("b"), _prefilled("c")
    source = half.hold(a, [3, 4, 5], 1)
    assert source == TransferSource("us", "a", [3, 4, 5], 1, 40, 16)
    half.hold(b, [6, 7, 8], 2)
    half.hold(c, [9, 10, 11], 0)
    clock.now += 2.0
    # a's reader is done; b's is queued for room and says so; a stranger's note changes nothing
    assert half.to_release([("done", "a"), ("keep", "b"), ("done", "nobody")]) == ["a"]
    assert half.release("a") is a and half.release("a") is None
    clock.now += 1.5  # c's lease (3 s) is over, b's was pushed back to 5 s
    assert half.to_release([]) == ["c"]
    assert half.leases_expired == 1
    assert half.release("c") is c
    assert half.to_release([("drop", "b")]) == ["b"]
    half.release("b")
    assert half.take_orders() == TransferOrders(releases=["a", "c", "b"])
    assert not half.held and not half.busy
    half.check_integrity()


def test_readers_queued_for_room_keep_their_leases_every_third_of_it() -> None:
    clock = Clock()
    half = _half(clock)
    queued, stranger, local = (
        _reader("q", 1),
        _reader("s", 1, agent="unmet"),
        Request(EngineCoreRequest("local", [1, 2, 3], PARAMS, [], 0.0), 4096),
    )
    half.meet("them", 3.0)
    sent = []
    for step in range(7):  # every 0.5 s
        half.keep_waiting([queued, stranger, local])
        sent += [(step, s.handle) for s in half.take_orders().keeps]
        clock.now += 0.5
    assert sent == [(2, "their-q"), (4, "their-q"), (6, "their-q")]
    half.pull(queued, [0], 0)  # admitted: no more keeps
    half.keep_waiting([])
    assert half.take_orders().keeps == []


def test_the_integrity_check_names_what_disagrees() -> None:
    half = _half(Clock(), role="prefill")
    half.hold(_prefilled("a"), [1], 0)
    half.leases.release("a")
    with pytest.raises(AssertionError, match=r"held requests \['a'\] != leased 0"):
        half.check_integrity()
    half = _half(Clock())
    half.pulling["ghost"] = _reader("ghost", 1)
    with pytest.raises(AssertionError, match=r"pulling \['ghost'\] != reading \[\] \+ ended \[\]"):
        half.check_integrity()
