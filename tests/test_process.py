"""The child-process helper: ready handshake, start-up failures named, dying with the parent, sockets removed; a
serving process's start-up heap kept out of garbage collection."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
import weakref
from pathlib import Path

import msgspec
import pytest

from hybridserve.process import ChildEnd, ChildProcesses, ChildStartupError, freeze_startup_heap

WAIT_S = 30.0


class Hello(msgspec.Struct, frozen=True):
    pid: int


def ready_then_wait_for_stop(in_addr: str, out_addr: str) -> None:
    child = ChildEnd(in_addr, out_addr)
    child.ready(Hello(os.getpid()))
    while not child.orphaned() and not child.inbox.poll(100):
        pass


def fail_at_start(in_addr: str, out_addr: str) -> None:
    ChildEnd(in_addr, out_addr).failed(FileNotFoundError("no checkpoint at /nowhere"))


def exit_at_start(in_addr: str, out_addr: str) -> None:
    raise SystemExit(3)


def never_ready(in_addr: str, out_addr: str) -> None:
    ChildEnd(in_addr, out_addr)
    time.sleep(WAIT_S)


def ready_then_sleep(in_addr: str, out_addr: str) -> None:
    """Only the kernel can end it early: it never looks at its parent."""
    ChildEnd(in_addr, out_addr).ready()
    time.sleep(WAIT_S)


def start_grandchild(pid_file: str) -> None:
    """A parent of its own: starts a child that only sleeps, reports its pid, then waits to be killed."""
    children = ChildProcesses("test-middle")
    _, in_addr = children.bind_push("in")
    inbox, out_addr = children.bind_pull("out")
    children.spawn(ready_then_sleep, (in_addr, out_addr), "test-grandchild")
    children.wait_ready(inbox, WAIT_S)
    Path(pid_file + ".tmp").write_text(str(children.processes[0].pid))
    os.replace(pid_file + ".tmp", pid_file)  # the test never reads half a pid
    time.sleep(WAIT_S)


def start(target, name: str = "test-child") -> tuple[ChildProcesses, object]:
    children = ChildProcesses("test")
    to_child, in_addr = children.bind_push("in")
    inbox, out_addr = children.bind_pull("out")
    children.spawn(target, (in_addr, out_addr), name)
    return children, (to_child, inbox)


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_ready_handshake_returns_what_the_child_sent_and_shutdown_removes_its_sockets():
    children, (to_child, inbox) = start(ready_then_wait_for_stop)
    socket_dir = Path(children.socket_dir)
    try:
        ready = children.wait_ready(inbox, WAIT_S)
        [process] = children.processes
        assert msgspec.msgpack.decode(ready["test-child"], type=Hello) == Hello(process.pid)
        assert sorted(p.name for p in socket_dir.iterdir()) == ["in", "out"]
        assert socket_dir.stat().st_mode & 0o077 == 0  # private to this user
    finally:
        children.shutdown(lambda _: to_child.send(b"stop"))
    assert process.exitcode == 0  # it left on the stop message, not by a kill
    assert not socket_dir.exists()


def test_a_start_up_failure_names_the_child_and_its_error_and_leaves_nothing_behind():
    children, (_, inbox) = start(fail_at_start, "test-engine")
    try:
        with pytest.raises(ChildStartupError, match=r"^test-engine failed to start: FileNotFoundError: no checkpoint"):
            children.wait_ready(inbox, WAIT_S)
        assert not any(p.is_alive() for p in children.processes)
        assert not Path(children.socket_dir).exists()
    finally:
        children.shutdown(lambda _: None)


def test_a_child_that_exits_during_start_up_is_named_with_its_exit_code():
    children, (_, inbox) = start(exit_at_start)
    try:
        with pytest.raises(ChildStartupError, match=r"^test-child exited \(exit code 3\) during start-up$"):
            children.wait_ready(inbox, WAIT_S)
    finally:
        children.shutdown(lambda _: None)


def test_a_child_that_never_reports_times_out_and_shutdown_kills_it(monkeypatch):
    monkeypatch.setattr("hybridserve.process.JOIN_TIMEOUT_S", 0.5)  # the join is bounded; not 5 s of waiting here
    children, (_, inbox) = start(never_ready)
    try:
        with pytest.raises(ChildStartupError, match=r"^test-child did not start within 0.5s$"):
            children.wait_ready(inbox, 0.5)
    finally:
        children.shutdown(lambda _: None)  # it ignores stop messages: the bounded join ends in a kill
    [process] = children.processes
    assert process.exitcode == -signal.SIGKILL


@pytest.mark.skipif(not os.path.exists("/proc"), reason="needs Linux (PR_SET_PDEATHSIG, /proc)")
def test_a_child_dies_with_its_parent(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    middle = multiprocessing.get_context("spawn").Process(target=start_grandchild, args=(str(pid_file),))
    middle.start()
    grandchild = None
    try:
        deadline = time.monotonic() + WAIT_S
        while grandchild is None:
            assert time.monotonic() < deadline, "the middle process never started its child"
            if pid_file.exists():
                grandchild = int(pid_file.read_text())
            time.sleep(0.05)
        assert not gone(grandchild)
        middle.kill()  # SIGKILL: the parent gets no chance to clean up
        middle.join(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not gone(grandchild):
            assert time.monotonic() < deadline, f"child {grandchild} outlived its parent"
            time.sleep(0.05)
    finally:
        middle.kill()
        middle.join(WAIT_S)
        if grandchild is not None and not gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_killed_parents_socket_directory_is_removed_by_the_next_start(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: the next ChildProcesses removes the directories of parents that no longer
    run, and leaves those of living ones (and anything not named like its own) alone."""
    from hybridserve.process import remove_stale_socket_dirs

    gone = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join(WAIT_S)
    stale = tmp_path / f"hybridserve-workers-{gone.pid}-abc123"
    alive = tmp_path / f"hybridserve-workers-{os.getpid()}-def456"
    other = tmp_path / "hybridserve-notes"
    for path in (stale, alive, other):
        path.mkdir()
    (stale / "w0").write_text("")  # a socket file left behind
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


class Node:
    other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """Two nodes that refer to each other and to nothing else: garbage only the collector can free."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def freeze_in_a_fresh_process(results: multiprocessing.Queue) -> None:
    gc.disable()  # only the collections asked for: none may free start-up's garbage by chance
    kept = [Node() for _ in range(1000)]  # start-up's live objects
    before = cycle()  # start-up's garbage
    frozen = freeze_startup_heap("test child")
    after = cycle()
    gc.collect()
    tracked = {id(o) for o in gc.get_objects()}
    results.put((before() is None, frozen, any(id(node) in tracked for node in kept), after() is None))


def test_freezing_the_start_up_heap_collects_its_garbage_first_and_keeps_collecting_later_garbage() -> None:
    """In a child process: the pytest process's heap stays as it is."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=freeze_in_a_fresh_process, args=(results,))
    child.start()
    try:
        before_collected, frozen, kept_tracked, after_collected = results.get(timeout=WAIT_S)
    finally:
        child.join(WAIT_S)
        child.kill()
    assert before_collected, "start-up's garbage cycle was frozen instead of collected"
    assert frozen >= 1000
    assert not kept_tracked, "start-up's objects are still walked by every full collection"
    assert after_collected, "a garbage cycle made after the freeze was not collected"
