"""The prefill side's hold on what it prefilled for a remote decode: each held request has a deadline, pushed
back when its reader says it is still waiting for room, and cleared when the reader says it is done. A request
whose deadline passes is released anyway, so a decode worker that died strands nothing for longer."""

from __future__ import annotations


class Leases:
    def __init__(self, lease_s: float) -> None:
        if not lease_s > 0:
            raise ValueError(f"a KV lease must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._deadline: dict[str, float] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deadline

    def __len__(self) -> int:
        return len(self._deadline)

    def hold(self, request_id: str, now: float) -> None:
        self._deadline[request_id] = now + self.lease_s

    def extend(self, request_id: str, now: float) -> None:
        if request_id in self._deadline:
            self._deadline[request_id] = now + self.lease_s

    def release(self, request_id: str) -> bool:
        return self._deadline.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
        """The requests whose lease ran out, no longer held."""
        gone = [rid for rid, deadline in self._deadline.items() if deadline <= now]
        for rid in gone:
            del self._deadline[rid]
        return gone
