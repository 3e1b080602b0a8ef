"""Engine configuration: frozen dataclasses, validated at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.sampling_params import InvalidParameter

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # GGUF file, HF directory, or None for the embedded default model
    served_model_name: str | None = None  # defaults to "smollm2" for the default, else the path's stem
    dtype: str = "auto"  # auto: bfloat16 on CUDA and bf16-capable CPUs, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 128
    # Token budget per engine step; default 512 on CPU (a burst of new prompts is prefilled in several
    # steps, so the first of them start streaming sooner), 2048 on CUDA.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 2 * 1024**3
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes (tests use tiny budgets)
    enable_prefix_caching: bool = True
    # Models with linear-attention layers: recurrent-state slots, one per running request (default:
    # max_num_seqs). Admission needs a free slot as well as KV blocks.
    num_state_slots: int | None = None
    # With prefix caching: snapshots of recurrent state at block boundaries, which prefix hits on such
    # models restore (default: as many as state slots; 0: none, so no prefix hits for these models).
    num_state_snapshots: int | None = None
    long_prefill_token_threshold: int = 0  # >0: a prefill chunk takes at most this many tokens per step
    # On CPU: decode attention and a layer's element-wise chains run as C kernels built at start-up with
    # the system C compiler (PyTorch ops if that fails, and always on CUDA). False: PyTorch ops only.
    native_kernels: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidParameter("dtype", f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidParameter(name, f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidParameter("max_model_len", f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise InvalidParameter("num_state_slots", f"num_state_slots must be positive, got {self.num_state_slots}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise InvalidParameter(
                "num_state_snapshots", f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidParameter("num_kv_blocks", f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.long_prefill_token_threshold < 0:
            raise InvalidParameter(
                "long_prefill_token_threshold",
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
            )

    def token_budget(self, device_type: str) -> int:
        """max_num_batched_tokens, or its default for the device the engine runs on."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if device_type == "cuda" else 512
