"""The NIXL side of a worker: its cache tensors registered once, reads from peers, notifications to them.

Reads are one-sided (the decode worker pulls; the prefill worker's engine does nothing while its memory is
read) and asynchronous: UCX's progress thread moves the bytes while the engine steps. NIXL has no deadline of
its own (a stopped peer leaves a read in progress forever), so the caller keeps one and cancels. A peer that
went away makes NIXL raise; that is turned into a failed read here, never an exception out of the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("hybridserve.kv_transfer")


class TransferError(RuntimeError):
    """A read that cannot complete: the peer is gone or NIXL reported an error."""


@dataclass
class Read:
    peer: str
    handle: Any  # nixl_xfer_handle


class TransferAgent:
    def __init__(self, name: str, tensors: Sequence[torch.Tensor], memory: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # heavy: UCX starts here

        self.name = name
        self.memory = memory
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._agent.register_memory(list(tensors))
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._peers: set[str] = set()

    def add_peer(self, metadata: bytes) -> None:
        name = self._agent.add_remote_agent(metadata)
        self._peers.add(name.decode() if isinstance(name, bytes) else name)

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray) -> Read:
        """Starts reading the peer's `remote` regions into our `local` ones (Nx3 arrays: address, length,
        device). Raises TransferError when it cannot even start."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, self.memory), agent.get_xfer_descs(remote, self.memory), peer
            )
            posted = agent.transfer(handle)
        except Exception as exc:  # nixlRemoteDisconnectError and kin: the peer is gone
            raise TransferError(f"reading from {peer} failed: {type(exc).__name__}: {exc}") from exc
        read = Read(peer, handle)
        if posted == "ERR":
            self.cancel(read)
            raise TransferError(f"NIXL could not post the read from {peer}")
        return read

    def done(self, read: Read) -> bool:
        """True once the read completed; raises TransferError if it failed."""
        try:
            state = self._agent.check_xfer_state(read.handle)
        except Exception as exc:
            raise TransferError(f"reading from {read.peer} failed: {type(exc).__name__}: {exc}") from exc
        if state == "ERR":
            raise TransferError(f"reading from {read.peer} failed: NIXL reported an error")
        return state == "DONE"

    def cancel(self, read: Read) -> bool:
        """Gives the read's handle back (cancelling it if it still runs). False if NIXL refused: the read may
        still write into our memory, so the caller must not reuse it yet and asks again later."""
        try:
            self._agent.release_xfer_handle(read.handle)
        except Exception as exc:
            logger.warning("NIXL did not release a read from %s yet: %s", read.peer, exc)
            return False
        return True

    def notify(self, peer: str, message: bytes) -> None:
        """Best effort: a peer that is gone cannot hear it, and its lease covers that."""
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            logger.warning("could not notify %s: %s", peer, exc)

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer, message) of every notification that arrived since the last call."""
        return [
            (peer.decode() if isinstance(peer, bytes) else peer, msg)
            for peer, msgs in self._agent.get_new_notifs().items()
            for msg in msgs
        ]
