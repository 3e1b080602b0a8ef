"""Child processes of the frontend: spawning, the ready handshake, dying with the parent, ipc addresses, shutdown.

The parent side is `ChildProcesses`: a private directory for the ipc socket files, the ZeroMQ contexts, the
spawned children and the handshake. The child side is `ChildEnd`: it asks the kernel to kill it with its
parent, watches the parent pid, connects its two pipes and reports ready (or why it could not start).
Every engine worker and post-processing worker starts and ends through these two.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_POLL_MS = 200
JOIN_TIMEOUT_S = 5.0


class ChildStarted(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A child's first message: it is ready, with what it wants the parent to know (`info`, msgpack bytes)."""

    child: str
    info: bytes = b""


class ChildFailed(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A child's first message when it cannot start."""

    child: str
    error: str


class ChildStartupError(RuntimeError):
    """A child did not become ready: it reported an error, exited, or ran out of time."""


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, however the parent ends (even SIGKILL)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def freeze_startup_heap(who: str) -> int:
    """Keep what start-up allocated out of the garbage collector's walks; returns how many objects that is.

    A full collection visits every object the collector tracks: in an engine worker or a frontend, with torch's
    modules, the model and the app loaded, about 400 k. At concurrency 64 one stopped a frontend's event loop for
    210 ms, and one an engine's step loop for 180 ms. Start-up's own garbage is collected first; the rest goes to
    the permanent generation (`gc.freeze`), which collections skip. Objects made later are collected as before.
    Called by each serving process once it is loaded, never by the offline `LLM`, whose heap is its caller's."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects from start-up kept out of garbage collection", who, frozen)
    return frozen


class ChildEnd:
    """A child's side: it dies with its parent, and has an inbox it pulls from and an outbox it pushes to (a child
    that serves on sockets of its own, like an engine worker, has neither)."""

    def __init__(self, in_addr: str | None = None, out_addr: str | None = None) -> None:
        self.name = multiprocessing.current_process().name
        parent = multiprocessing.parent_process()
        self.parent = os.getppid() if parent is None else parent.pid
        die_with_parent()
        if self.orphaned():  # the parent died before the kernel hook was set: it will never fire
            raise SystemExit(f"{self.name}: parent process {self.parent} is gone")
        ctx = zmq.Context()
        self.inbox = ctx.socket(zmq.PULL)
        self.outbox = ctx.socket(zmq.PUSH)
        if in_addr is not None:
            self.inbox.connect(in_addr)
        if out_addr is not None:
            self.outbox.connect(out_addr)
        self._encode = msgspec.msgpack.Encoder().encode

    def orphaned(self) -> bool:
        """The parent is gone (where the kernel hook is missing): nobody reads this child's outputs."""
        return os.getppid() != self.parent

    def ready(self, info: msgspec.Struct | None = None) -> None:
        """Tell the parent this child is ready; `info` (e.g. what the engine loaded) goes with it."""
        self.outbox.send(self._encode(ChildStarted(self.name, b"" if info is None else self._encode(info))))

    def failed(self, exc: BaseException) -> None:
        self.outbox.send(self._encode(ChildFailed(self.name, f"{type(exc).__name__}: {exc}")))


def remove_stale_socket_dirs(root: str | None = None) -> list[str]:
    """Removes the socket directories (in `root`, default the temp directory) that this user's earlier parents
    left when they were killed (SIGKILL runs no cleanup): those whose pid no longer runs. Returns them."""
    removed = []
    base = Path(root or tempfile.gettempdir())
    for path in base.glob("hybridserve-*-*-*"):
        match = re.fullmatch(r"hybridserve-[a-z]+-(\d+)-\w+", path.name)
        if match is None or not path.is_dir() or path.stat().st_uid != os.getuid():
            continue
        if not _running(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def exit_description(process: BaseProcess) -> str:
    return f"{process.name} exited (exit code {process.exitcode})"


class ChildProcesses:
    """The parent's side of a set of children: their socket files (in a private directory), ZeroMQ contexts,
    processes, ready handshake and shutdown. Sends from the parent are synchronous; receives are asyncio."""

    def __init__(self, label: str) -> None:
        self.label = label
        remove_stale_socket_dirs()
        # The name carries this process's pid, so a later start can tell the directory of a killed one.
        self.socket_dir = tempfile.mkdtemp(prefix=f"hybridserve-{label}-{os.getpid()}-")
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self.processes: list[BaseProcess] = []

    def address(self, name: str) -> str:
        """The ipc address of socket `name`; ValueError when the path would not fit a Unix socket address
        (with room for a worker's `-kv` events socket beside it)."""
        path = f"{self.socket_dir}/{name}"
        if len(path) + len("-kv") > _IPC_PATH_MAX:
            raise ValueError(
                f"the socket path {path} is longer than a Unix socket allows ({_IPC_PATH_MAX} bytes with its -kv "
                "sibling): set TMPDIR to a shorter directory"
            )
        return f"ipc://{path}"

    def bind_push(self, name: str) -> tuple[zmq.Socket, str]:
        """A bound PUSH socket (synchronous: below its high-water mark a send never blocks) and its address."""
        sock = self._sync_ctx.socket(zmq.PUSH)
        sock.bind(self.address(name))
        return sock, self.address(name)

    def bind_pull(self, name: str) -> tuple[zmq.asyncio.Socket, str]:
        """A bound asyncio PULL socket and its address."""
        sock = self._ctx.socket(zmq.PULL)
        sock.bind(self.address(name))
        return sock, self.address(name)

    def spawn(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> BaseProcess:
        process = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name, daemon=True)
        process.start()
        self.processes.append(process)
        return process

    def forget(self, process: BaseProcess) -> None:
        """A child that has exited and is replaced: shutdown no longer waits for it."""
        process.join(0)
        self.processes.remove(process)

    def wait_ready(self, inbox: zmq.asyncio.Socket, timeout_s: float) -> dict[str, bytes]:
        """Block (before any event loop runs) until every child has reported ready on `inbox`; what each sent
        (`ChildStarted.info`) by child name. Raises ChildStartupError naming the child when one reports a
        failure, exits, or time runs out, after stopping every child."""
        try:
            return self._wait_ready(inbox, timeout_s)
        except ChildStartupError:  # a failed start leaves no child and no socket file behind
            self.shutdown(lambda _: None)
            raise

    def _wait_ready(self, inbox: zmq.asyncio.Socket, timeout_s: float) -> dict[str, bytes]:
        sync = zmq.Socket.shadow(inbox.underlying)
        decode = msgspec.msgpack.Decoder(ChildStarted | ChildFailed).decode
        ready: dict[str, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.processes):
            if sync.poll(_POLL_MS):
                msg = decode(sync.recv())
                if isinstance(msg, ChildFailed):
                    raise ChildStartupError(f"{msg.child} failed to start: {msg.error}")
                ready[msg.child] = msg.info
                continue
            for process in self.processes:
                if not process.is_alive():
                    raise ChildStartupError(f"{exit_description(process)} during start-up")
            if time.monotonic() > deadline:
                waiting = sorted(p.name for p in self.processes if p.name not in ready)
                raise ChildStartupError(f"{', '.join(waiting)} did not start within {timeout_s:g}s")
        return ready

    def shutdown(self, stop: Callable[[BaseProcess], None]) -> None:
        """`stop` asks each living child to exit; then a bounded join, a kill for the stuck (they hold nothing
        that must be saved), the contexts closed and the socket directory removed."""
        for process in self.processes:
            if process.is_alive():
                stop(process)
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(JOIN_TIMEOUT_S)
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
