"""At start-up the deployment's geometry comes from the first accepted worker in `--worker` order, not from
whichever answered first: two fake workers on loopback, the one listed second answering at once with another
block size, the one listed first half a second later."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from hybridserve.engine.protocol import EngineFacts, Welcome, WorkerIdentity
from hybridserve.router.link import WorkerLink, WorkerState
from hybridserve.router.router import ExpectedModel, Router, RouterSettings

EXPECTED = ExpectedModel("smollm2", "w" * 16, "t" * 16)


def _identity(block_size: int) -> WorkerIdentity:
    return WorkerIdentity("smollm2", "w" * 16, "t" * 16, "float32", False, EngineFacts(2048, 49152, 100, block_size))


def _fake_worker(ctx: zmq.Context, block_size: int, delay_s: float) -> tuple[str, threading.Thread]:
    """A ROUTER socket that answers the first Hello with a Welcome after `delay_s`; its address."""
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        try:
            if not sock.poll(10_000):
                return
            sender, _ = sock.recv_multipart()
            time.sleep(delay_s)
            welcome = Welcome(_identity(block_size), "tcp://127.0.0.1:1")
            sock.send_multipart([sender, msgspec.msgpack.encode(welcome)])
            time.sleep(0.5)  # let it leave before the socket closes
        finally:
            sock.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


def test_the_first_listed_worker_fixes_the_geometry_even_when_it_answers_last() -> None:
    ctx = zmq.Context()
    try:
        late, late_thread = _fake_worker(ctx, 16, 0.5)
        early, early_thread = _fake_worker(ctx, 32, 0.0)
        links = [WorkerLink(name="late", address=late), WorkerLink(name="early", address=early)]
        router = Router(links, EXPECTED, RouterSettings())
        router.wait_for_workers(timeout_s=10.0, require_all=False)
        assert router.identity is not None and router.identity.facts.block_size == 16
        assert links[1].state is WorkerState.REFUSED
        assert links[1].error == "block_size 32 != 16 (the deployment's, set by worker late)"
        for thread in (late_thread, early_thread):
            thread.join(timeout=5)
    finally:
        ctx.destroy(linger=0)
