"""Tokenizer loading and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(hf_dir: Path) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer stored in the local directory `hf_dir`; never reaches for the Hub."""
    if not hf_dir.is_dir():
        raise ValueError(f"cannot load a tokenizer from {hf_dir}: not a directory")
    try:
        return AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types here; re-raised naming the directory
        raise ValueError(f"cannot load a tokenizer from {hf_dir}: {e}") from e
