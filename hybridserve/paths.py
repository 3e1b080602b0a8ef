"""Where hybridserve keeps artefacts it derives once and reuses across starts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """`$HYBRIDSERVE_CACHE_DIR/<kind>`, default `~/.cache/hybridserve/<kind>` (converted models, kernels)."""
    env = os.environ.get("HYBRIDSERVE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "hybridserve") / kind
