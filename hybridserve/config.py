"""Engine and serving configuration: frozen dataclasses, validated at construction with errors that name the field.

Each field is declared with `setting`, which also describes its `hybridserve serve` flag."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from hybridserve.sampling_params import InvalidParameter
from hybridserve.speculative import SpeculativeConfig, parse_speculative_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
GENERATION_CONFIGS = ("auto", "none")
ROLES = ("both", "prefill", "decode")
TRANSFER_FAILURE_POLICIES = ("fail", "recompute")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'2GiB' / '512MiB' / '1.5G' / '2GB' (decimal) / '1073741824' → bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 2GiB, 512MiB or 1073741824, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def env_bool(variable: str, default: bool) -> bool:
    """$variable as a bool setting's default: 1 or 0; unset or empty keeps `default`."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${variable} must be 1 or 0, got {value!r}")
    return default if value == "" else value == "1"


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A config field and its `hybridserve serve` flag (serving/cli.py makes one per field): `help` is the flag's
    help; `flag` holds argparse options the field's type does not imply (choices, a `type` that parses text,
    `positional=True`, and for a bool `env`: the variable that, set to 1 or 0, gives the flag its default)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(
        None, "GGUF file or Hugging Face directory; None: the embedded SmolLM2-135M", positional=True
    )
    served_model_name: str | None = setting(
        None, "model id clients send and see; None: smollm2, or the model path's stem"
    )
    generation_config: str = setting(
        "auto",
        "sampling defaults of requests that leave out temperature, top_p, top_k, min_p or repetition_penalty (auto: "
        "those the model's generation_config.json sets, as vLLM does; none: OpenAI's, temperature 1 and top_p 1 with "
        "no top_k, min_p or repetition penalty)",
        choices=GENERATION_CONFIGS,
    )
    dtype: str = setting(
        "auto",
        "weight, activation and KV-cache dtype (auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else "
        "float32)",
        choices=DTYPES,
    )
    device: str = setting("auto", "cuda, cpu, or auto (cuda when available, else cpu)")
    max_model_len: int | None = setting(None, "context length limit (prompt + completion); None: the model's")
    max_num_seqs: int = setting(128, "most sequences in one engine step")
    max_num_batched_tokens: int | None = setting(
        None,
        "token budget of one engine step (default: 512 on CPU, so a burst of new prompts is prefilled over several "
        "steps and the first of them start streaming sooner; 2048 on CUDA)",
    )
    block_size: int = setting(16, "tokens per KV-cache block")
    kv_cache_memory_bytes: int = setting(
        2 * 1024**3, "memory for the KV cache: bytes, or with a unit such as 2GiB or 512MiB", type=parse_bytes
    )
    kv_cache_prefault: bool = setting(
        env_bool("HYBRIDSERVE_KV_CACHE_PREFAULT", True),
        "CPU: write every page of the KV cache (and a hybrid model's state pool) at start-up, as vLLM does, so "
        "the memory is taken at once and the first pass through the cache does not fault its pages in one at a "
        "time inside the steps (on a VM ~1 ms a 16-token block; a fresh server then serves 1.14-1.19x the tokens "
        "at 8-32 requests); start-up takes ~2 s more a GiB there. --no-kv-cache-prefault (or "
        "$HYBRIDSERVE_KV_CACHE_PREFAULT=0, the tests' setting): pages taken as used",
        env="HYBRIDSERVE_KV_CACHE_PREFAULT",
    )
    num_kv_blocks: int | None = setting(None, "number of KV-cache blocks (overrides --kv-cache-memory-bytes)")
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of earlier prompts with the same prefix")
    num_state_slots: int | None = setting(
        None,
        "models with linear attention: recurrent-state slots, one per running request; admission needs a free slot "
        "as well as KV blocks (default: max-num-seqs)",
    )
    num_state_snapshots: int | None = setting(
        None,
        "models with linear attention: recurrent-state snapshots kept for prefix-cache hits, evicted least "
        "recently used (default: as many as state slots; 0 turns prefix hits off for these models)",
    )
    long_prefill_token_threshold: int = setting(0, "if >0, a prefill chunk takes at most this many tokens per step")
    long_prefill_share: float = setting(
        0.25,
        "share of the step token budget a prefill chunk takes before the other requests of its priority have theirs "
        "(shorter new prompts are admitted beside it, shorter prefills go on), so a long prompt does not hold up "
        "short ones; what they leave goes back to the prefills, fewest tokens left first, so a lone long prompt "
        "still fills the step, and only then are prompts no shorter admitted, in turn (1: a running prefill takes "
        "all the budget it can)",
    )
    batch_step_tokens: int = setting(
        32,
        "tokens of a step that less urgent requests (batch requests) may take while more urgent ones (online) run "
        "or wait, so online steps stay short; alone, batch requests take the whole budget (0: no limit)",
    )
    native_kernels: bool = setting(
        True,
        "on CPU, run decode attention, the KDA decode step, fused element-wise ops and float32 matmuls as C kernels "
        "built at start-up with the system C compiler ($CC, default cc) for this CPU's instruction sets, or for no "
        "higher a level than $HYBRIDSERVE_MAX_CPU_ISA (avx2, avx512, avx512_bf16, amx); PyTorch ops if they cannot be "
        "built, and always on CUDA",
    )
    gguf_blocks: bool = setting(
        True,
        "on CPU in float32 with native kernels, sum a GGUF model's Q4_0, Q4_1 and Q8_0 matmul weights (projections, "
        "head) from their blocks, dequantized in the cache as the matmuls need them: the same float32 sums bit for "
        "bit from 19% (Q4_x) or 28% (Q8_0) of the weight bytes (--no-gguf-blocks: float32 copies)",
    )
    cuda_graphs: bool = setting(
        True,
        "on CUDA, replay decode-only steps of Llama-family models from CUDA graphs, captured the first time a step "
        "needs its padded batch size and block-table width (launching each op on its own bounds a small model's "
        "step); --no-cuda-graphs launches every op of every step, as vLLM's --enforce-eager",
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1} drafts tokens by looking the request\'s last tokens up earlier in its prompt and '
        'output; {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24, '
        '"suffix_decoding_max_cached_requests": 1000, "suffix_decoding_max_spec_factor": 1.0, '
        '"suffix_decoding_min_token_prob": 0.1} drafts the most frequent continuation of the longest matched suffix '
        "in suffix trees of the request's tokens and of recent requests' outputs, as long as the match allows. "
        "Either verifies the draft in one forward (lossless; requests with structured output take no drafts); a "
        "mapping in a --config file or the LLM API; default off",
        type=parse_speculative_config,
    )
    seed: int = setting(0, "engine random seed")
    num_threads: int | None = setting(
        None, "CPU threads of each engine worker (default: the machine's cores, divided among --num-workers)"
    )
    role: str = setting(
        "both",
        "worker: both (prefill and decode its requests), prefill (also hold a prefilled request's KV and state for "
        "a decode worker to read over NIXL) or decode (also read them from prefill workers)",
        choices=ROLES,
    )
    kv_lease: float = setting(
        30.0, "prefill worker: seconds it holds a prefilled request's KV with no word from the decode worker"
    )
    kv_transfer_timeout: float = setting(
        10.0, "decode worker: seconds a KV and state read may take before it is cancelled (a hung prefill worker)"
    )
    kv_transfer_max_bytes: int = setting(
        1024**3,
        "decode worker: bytes of KV and state reads in flight at once; more wait their turn (one always runs)",
        type=parse_bytes,
    )
    kv_staging_bytes: int = setting(
        256 * 1024**2,
        "prefill and decode workers: size of the registered staging arena a request's fragmented KV blocks are "
        "packed into, so a read is one descriptor instead of one per block; 0: always read the blocks directly",
        type=parse_bytes,
    )
    kv_staging_min_run: float = setting(
        2.0,
        "prefill and decode workers: stage a request whose KV blocks lie in runs of consecutive blocks shorter "
        "than this on average; inf stages every request (docs/benchmarks.md has the measurement behind 2)",
    )
    kv_transfer_failure: str = setting(
        "fail",
        "decode worker, when a read fails or times out: fail the request, or recompute its prompt here",
        choices=TRANSFER_FAILURE_POLICIES,
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):  # a --config file's or the LLM API's mapping
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.dtype not in DTYPES:
            raise InvalidParameter("dtype", f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise InvalidParameter(
                "generation_config",
                f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}",
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes", "num_threads"):
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
        if self.role not in ROLES:
            raise InvalidParameter("role", f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transfer_failure not in TRANSFER_FAILURE_POLICIES:
            raise InvalidParameter(
                "kv_transfer_failure",
                f"kv_transfer_failure must be one of {TRANSFER_FAILURE_POLICIES}, got {self.kv_transfer_failure!r}",
            )
        if self.kv_staging_bytes < 0:
            raise InvalidParameter("kv_staging_bytes", f"kv_staging_bytes must be >= 0, got {self.kv_staging_bytes}")
        if not self.kv_staging_min_run >= 0:  # inf: stage every request
            raise InvalidParameter(
                "kv_staging_min_run", f"kv_staging_min_run must be >= 0, got {self.kv_staging_min_run}"
            )
        for name in ("kv_lease", "kv_transfer_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise InvalidParameter(name, f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.kv_transfer_max_bytes < 1:
            raise InvalidParameter(
                "kv_transfer_max_bytes", f"kv_transfer_max_bytes must be positive, got {self.kv_transfer_max_bytes}"
            )
        if self.long_prefill_token_threshold < 0:
            raise InvalidParameter(
                "long_prefill_token_threshold",
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
            )
        if self.batch_step_tokens < 0:
            raise InvalidParameter("batch_step_tokens", f"batch_step_tokens must be >= 0, got {self.batch_step_tokens}")
        if not 0 < self.long_prefill_share <= 1:
            raise InvalidParameter(
                "long_prefill_share", f"long_prefill_share must be in (0, 1], got {self.long_prefill_share}"
            )

    def token_budget(self, device_type: str) -> int:
        """max_num_batched_tokens, or its default for the device the engine runs on."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if device_type == "cuda" else 512


ROUTING = ("round_robin", "least_load", "kv_aware")


@dataclass(frozen=True)
class DeploymentConfig:
    """Which engine workers one frontend uses and how it routes among them (docs/deployment.md)."""

    workers: list[str] | None = setting(
        None,
        "a remote engine worker (`hybridserve worker`) to use, as tcp://HOST:PORT; repeat for several",
        flag="--worker",
        metavar="URL",
    )
    num_workers: int | None = setting(
        None,
        "engine workers to start on this host, each with its share of the CPU threads (default: 1 without "
        "--worker, else 0)",
    )
    routing: str | None = setting(
        None,
        "how a new request picks its worker (default: kv_aware with more than one worker)",
        choices=ROUTING,
    )
    routing_prefix_weight: float = setting(
        4.0,
        "kv_aware: what one KV block of the prompt already cached on a worker is worth against one block of load "
        "there (higher: stronger affinity, less balance)",
    )
    routing_temperature: float = setting(
        0.0, "kv_aware and least_load: 0 picks the cheapest worker; above 0 draws among near-equal ones"
    )
    worker_timeout: float = setting(
        10.0,
        "seconds without a transport heartbeat (answered by the worker's I/O thread, also mid-step) after which a "
        "worker counts as down: killed, stopped or unreachable (its requests fail, others go on)",
    )
    worker_step_timeout: float = setting(
        300.0,
        "seconds a worker whose connection is alive may leave pings unanswered (its engine loop answers between "
        "steps) before it counts as hung and down",
    )
    worker_api_key: str | None = setting(
        None, "the shared secret remote workers expect (their --api-key); $HYBRIDSERVE_WORKER_API_KEY also sets it"
    )
    prefill_workers: list[str] | None = setting(
        None,
        "disaggregated: a remote prefill worker (`hybridserve worker --role prefill`), as tcp://HOST:PORT; repeat",
        flag="--prefill-worker",
        metavar="URL",
    )
    decode_workers: list[str] | None = setting(
        None,
        "disaggregated: a remote decode worker (`hybridserve worker --role decode`), as tcp://HOST:PORT; repeat",
        flag="--decode-worker",
        metavar="URL",
    )
    num_prefill_workers: int = setting(0, "disaggregated: prefill workers to start on this host")
    num_decode_workers: int = setting(0, "disaggregated: decode workers to start on this host")
    max_local_prefill_tokens: int = setting(
        256,
        "disaggregated: a decode worker prefills a request itself when the part of its prompt it does not hold "
        "is at most this many tokens (0: every request is prefilled by a prefill worker)",
    )

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 0:
            raise InvalidParameter("num_workers", f"num_workers must be >= 0, got {self.num_workers}")
        for name in ("num_prefill_workers", "num_decode_workers", "max_local_prefill_tokens"):
            if getattr(self, name) < 0:
                raise InvalidParameter(name, f"{name} must be >= 0, got {getattr(self, name)}")
        prefill = self.num_prefill_workers + len(self.prefill_workers or ())
        decode = self.num_decode_workers + len(self.decode_workers or ())
        if bool(prefill) != bool(decode):
            missing = "decode" if prefill else "prefill"
            raise InvalidParameter(
                f"{missing}_workers",
                f"a disaggregated deployment needs {missing} workers too: --num-{missing}-workers or "
                f"--{missing}-worker (it has {prefill} prefill and {decode} decode workers)",
            )
        if prefill and (self.num_workers or self.workers):
            raise InvalidParameter(
                "workers",
                "a deployment is either aggregated (--num-workers, --worker) or disaggregated (prefill and decode "
                "workers), not both",
            )
        if self.local_workers + len(self.workers or ()) + prefill + decode < 1:
            raise InvalidParameter("num_workers", "a deployment needs at least one worker: --num-workers or --worker")
        if self.routing is not None and self.routing not in ROUTING:
            raise InvalidParameter("routing", f"routing must be one of {ROUTING}, got {self.routing!r}")
        if not 0 <= self.routing_temperature < float("inf"):
            raise InvalidParameter(
                "routing_temperature",
                f"routing_temperature must be a finite number >= 0, got {self.routing_temperature}",
            )
        if not 0 < self.routing_prefix_weight < float("inf"):
            raise InvalidParameter(
                "routing_prefix_weight",
                f"routing_prefix_weight must be a positive finite number, got {self.routing_prefix_weight}",
            )
        for name in ("worker_timeout", "worker_step_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise InvalidParameter(name, f"{name} must be positive, got {getattr(self, name)}")

    @property
    def disaggregated(self) -> bool:
        return bool(self.num_prefill_workers or self.prefill_workers)

    @property
    def local_workers(self) -> int:
        """Aggregated workers to start on this host."""
        if self.num_workers is not None:
            return self.num_workers
        return 0 if self.workers or self.disaggregated else 1

    @property
    def num_all_workers(self) -> int:
        pools = self.num_prefill_workers + self.num_decode_workers
        return (
            self.local_workers
            + len(self.workers or ())
            + pools
            + len(self.prefill_workers or ())
            + len(self.decode_workers or ())
        )

    @property
    def routing_policy(self) -> str:
        if self.routing is not None:
            return self.routing
        return "kv_aware" if self.num_all_workers > 1 else "round_robin"


@dataclass(frozen=True)
class ExtensionConfig:
    """Deployment switches of the model-specific serving extensions (serving/extensions/); the frontend's alone,
    never sent to the engine. Each extension reads its own and ignores the rest."""

    kimi_param_policy: bool = setting(
        False,
        "Kimi-K3 models: enforce the sampling-parameter policy (top_p unset or 1.0 becomes 0.95; any other top_p, a "
        "temperature outside [0, 1], a non-zero penalty or n other than 1 is a 400); "
        "$HYBRIDSERVE_KIMI_PARAM_POLICY=1 or 0 sets the default",
        env="HYBRIDSERVE_KIMI_PARAM_POLICY",
    )
