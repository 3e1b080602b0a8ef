"""The engine workers `serve` runs on this host: child processes on ipc addresses in a private directory.

Each gets its share of the CPU threads (unless --num-threads says otherwise), dies with the frontend, stops on
SIGTERM, and is started again by the router when it dies.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hybridserve.config import EngineConfig
from hybridserve.engine.worker import run_local_worker
from hybridserve.process import ChildProcesses
from hybridserve.router.link import WorkerLink


class LocalWorkers:
    def __init__(self, config: EngineConfig, hf_dir: Path, model_name: str, roles: list[str]) -> None:
        """One worker per entry of `roles` (both, prefill or decode)."""
        count = len(roles)
        if count < 1:
            raise ValueError(f"the number of local workers must be at least 1, got {count}")
        threads = config.parallel.num_threads or max(1, (os.cpu_count() or 1) // count)
        self.config = config.replace(num_threads=threads) if count > 1 else config
        self.hf_dir = hf_dir
        self.model_name = model_name
        self.children = ChildProcesses("workers")
        seen: dict[str, int] = {}
        self.links = []
        for i, role in enumerate(roles):
            n = seen[role] = seen.get(role, -1) + 1
            name = f"local-{n}" if role == "both" else f"local-{role}-{n}"
            self.links.append(WorkerLink(name, self.children.address(f"w{i}"), role))
        for link in self.links:
            self.start(link)

    def start(self, link: WorkerLink) -> None:
        """Starts (or starts again) the process of a local worker."""
        if link.process is not None:
            self.children.forget(link.process)
        config = self.config.replace(role=link.role)
        args = (config, self.hf_dir, self.model_name, link.address)
        link.process = self.children.spawn(run_local_worker, args, f"hybridserve-engine-{link.name}")

    def shutdown(self) -> None:
        self.children.shutdown(lambda process: os.kill(process.pid, signal.SIGTERM) if process.pid else None)
