"""Engine and serving configuration: frozen dataclasses, validated at construction with errors that name the field.

Each field is declared with `setting`, which also describes its `hybridserve serve` flag."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from hybridserve.sampling_params import InvalidParameter
from hybridserve.speculative import SpeculativeConfig, parse_speculative_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
GENERATION_CONFIGS = ("auto", "none")
SCHEDULING_POLICIES = ("fcfs", "priority")
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


def setting(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    finite: bool = True,
    **flag: Any,
) -> Any:
    """A config field and its command-line flag (serving/flags.py makes one per field): `help` is the flag's help;
    `min` / `max` bound a number (inclusive), `above` bounds it from below (exclusive), and a float must be finite
    unless `finite` is False, all checked at construction (None always passes: "not set"); `flag` holds argparse
    options the field's type does not imply (choices, also checked, a `type` that parses text, `positional=True`, and
    for a bool `env`: the variable that, set to 1 or 0, gives the flag its default; the CLI reads it)."""
    bounds = {"min": min, "max": max, "above": above, "finite": finite}
    return field(default=default, metadata={"help": help, "bounds": bounds, **flag})


def part(kind: type) -> Any:
    """A field of EngineConfig holding one of its parts, default-constructed; its fields are flags of their own."""
    return field(default_factory=kind, metadata={"part": True})


def check_settings(config: Any) -> None:
    """Raises InvalidParameter, naming the field and its value, for a value out of its field's choices or bounds."""
    for f in fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if value is None or "bounds" not in meta:
            continue
        if "choices" in meta and value not in meta["choices"]:
            raise InvalidParameter(f.name, f"{f.name} must be one of {tuple(meta['choices'])}, got {value!r}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            _check_bounds(f.name, value, **meta["bounds"])


def _check_bounds(
    name: str, value: float, min: float | None, max: float | None, above: float | None, finite: bool
) -> None:
    bounded = min is not None or max is not None or above is not None
    if (
        math.isnan(value)
        and bounded
        or (min is not None and value < min)
        or (max is not None and value > max)
        or (above is not None and value <= above)
    ):
        if max is not None:
            text = f"in ({above}, {max}]" if above is not None else f"in [{min}, {max}]"
        else:
            text = "positive" if min == 1 or above == 0 else f">= {min}" if above is None else f"> {above}"
        raise InvalidParameter(name, f"{name} must be {text}, got {value}")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise InvalidParameter(name, f"{name} must be a finite number, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """What the engine loads and runs it in."""

    model: str | None = setting(
        None, "GGUF file or Hugging Face directory; None: the embedded SmolLM2-135M", positional=True
    )
    dtype: str = setting(
        "auto",
        "weight, activation and KV-cache dtype (auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else "
        "float32)",
        choices=DTYPES,
    )
    device: str = setting("auto", "cuda, cpu, or auto (cuda when available, else cpu)")
    max_model_len: int | None = setting(None, "context length limit (prompt + completion); None: the model's", min=1)
    seed: int = setting(0, "engine random seed")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache and, for models with linear attention, the recurrent-state pool."""

    block_size: int = setting(16, "tokens per KV-cache block", min=1)
    kv_cache_memory_bytes: int = setting(
        2 * 1024**3, "memory for the KV cache: bytes, or with a unit such as 2GiB or 512MiB", type=parse_bytes, min=1
    )
    kv_cache_prefault: bool = setting(
        True,
        "CPU: write every page of the KV cache (and a hybrid model's state pool) at start-up, as vLLM does, so "
        "the memory is taken at once and the first pass through the cache does not fault its pages in one at a "
        "time inside the steps (on a VM ~1 ms a 16-token block; a fresh server then serves 1.14-1.19x the tokens "
        "at 8-32 requests); start-up takes ~2 s more a GiB there. --no-kv-cache-prefault (or "
        "$HYBRIDSERVE_KV_CACHE_PREFAULT=0, the tests' setting): pages taken as used",
        env="HYBRIDSERVE_KV_CACHE_PREFAULT",
    )
    num_kv_blocks: int | None = setting(None, "number of KV-cache blocks (overrides --kv-cache-memory-bytes)", min=1)
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of earlier prompts with the same prefix")
    num_state_slots: int | None = setting(
        None,
        "models with linear attention: recurrent-state slots, one per running request; admission needs a free slot "
        "as well as KV blocks (default: max-num-seqs)",
        min=1,
    )
    num_state_snapshots: int | None = setting(
        None,
        "models with linear attention: recurrent-state snapshots kept for prefix-cache hits, evicted least "
        "recently used (default: as many as state slots; 0 turns prefix hits off for these models)",
        min=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may hold, and how prefills, priorities and drafts share it."""

    max_num_seqs: int = setting(128, "most sequences in one engine step", min=1)
    max_num_batched_tokens: int | None = setting(
        None,
        "token budget of one engine step (default: 512 on CPU, so a burst of new prompts is prefilled over several "
        "steps and the first of them start streaming sooner; 2048 on CUDA)",
        min=1,
    )
    long_prefill_token_threshold: int = setting(
        0, "if >0, a prefill chunk takes at most this many tokens per step", min=0
    )
    long_prefill_share: float = setting(
        0.25,
        "share of the step token budget a prefill chunk takes before the other requests of its priority have theirs "
        "(shorter new prompts are admitted beside it, shorter prefills go on), so a long prompt does not hold up "
        "short ones; what they leave goes back to the prefills, fewest tokens left first, so a lone long prompt "
        "still fills the step, and only then are prompts no shorter admitted, in turn (1: a running prefill takes "
        "all the budget it can)",
        above=0,
        max=1,
    )
    batch_step_tokens: int = setting(
        32,
        "tokens of a step that batch requests (the Batch API's, run-batch's) may take while online requests run or "
        "wait, so online steps stay short; alone, batch requests take the whole budget (0: no limit)",
        min=0,
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

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):  # a --config file's or the LLM API's mapping
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        check_settings(self)

    def token_budget(self, device_type: str) -> int:
        """max_num_batched_tokens, or its default for the device the engine runs on."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if device_type == "cuda" else 512


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine worker spreads over CPU threads and, once model parallelism is served, over processes."""

    num_threads: int | None = setting(
        None, "CPU threads of each engine worker (default: the machine's cores, divided among --num-workers)", min=1
    )
    tensor_parallel_size: int = setting(1, "processes (ranks) each holding a slice of every layer's weights", min=1)
    pipeline_parallel_size: int = setting(1, "processes (stages) each holding a run of the model's layers", min=1)
    expert_parallel_size: int = setting(1, "processes each holding a share of a MoE model's experts", min=1)

    def __post_init__(self) -> None:
        check_settings(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(self, name) != 1:
                raise InvalidParameter(
                    name, f"{name} is {getattr(self, name)}, but this version runs each worker in one process: only 1"
                )


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation of the model's operations runs."""

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

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class TransferConfig:
    """Disaggregated serving: a worker's role, and how a decode worker reads a prefill worker's KV and state."""

    role: str = setting(
        "both",
        "worker: both (prefill and decode its requests), prefill (also hold a prefilled request's KV and state for "
        "a decode worker to read over NIXL) or decode (also read them from prefill workers)",
        choices=ROLES,
    )
    kv_lease: float = setting(
        30.0,
        "prefill worker: seconds it holds a prefilled request's KV with no word from the decode worker",
        above=0,
    )
    kv_transfer_timeout: float = setting(
        10.0,
        "decode worker: seconds a KV and state read may take before it is cancelled (a hung prefill worker)",
        above=0,
    )
    kv_transfer_max_bytes: int = setting(
        1024**3,
        "decode worker: bytes of KV and state reads in flight at once; more wait their turn (one always runs)",
        type=parse_bytes,
        min=1,
    )
    kv_staging_bytes: int = setting(
        256 * 1024**2,
        "prefill and decode workers: size of the registered staging arena a request's fragmented KV blocks are "
        "packed into, so a read is one descriptor instead of one per block; 0: always read the blocks directly",
        type=parse_bytes,
        min=0,
    )
    kv_staging_min_run: float = setting(
        2.0,
        "prefill and decode workers: stage a request whose KV blocks lie in runs of consecutive blocks shorter "
        "than this on average; inf stages every request (docs/benchmarks.md has the measurement behind 2)",
        min=0,
        finite=False,
    )
    kv_transfer_failure: str = setting(
        "fail",
        "decode worker, when a read fails or times out: fail the request, or recompute its prompt here",
        choices=TRANSFER_FAILURE_POLICIES,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine worker needs, in parts, each handed only to what uses it (the runner takes the model, cache,
    parallel and kernel parts, the scheduler its own, the KV connector the transfer part). `of(**values)` builds one
    from the parts' field names, as the flags and the `LLM` API give them."""

    model: ModelConfig = part(ModelConfig)
    cache: CacheConfig = part(CacheConfig)
    scheduler: SchedulerConfig = part(SchedulerConfig)
    parallel: ParallelConfig = part(ParallelConfig)
    kernels: KernelConfig = part(KernelConfig)
    transfer: TransferConfig = part(TransferConfig)

    @classmethod
    def of(cls, **values: Any) -> EngineConfig:
        """The config whose parts take these values by field name (`EngineConfig.of(dtype="float32", block_size=4)`);
        a name no part has is an error naming it."""
        kwargs: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        owners = {g.name: f.name for f in fields(cls) for g in fields(_PARTS[f.name])}
        for name, value in values.items():
            if name not in owners:
                raise TypeError(f"EngineConfig has no setting {name!r}")
            kwargs[owners[name]][name] = value
        return cls(**{name: _PARTS[name](**kw) for name, kw in kwargs.items()})

    def replace(self, **values: Any) -> EngineConfig:
        """This config with these settings changed, by field name as `of` takes them."""
        current = {g.name: getattr(getattr(self, f.name), g.name) for f in fields(self) for g in fields(_PARTS[f.name])}
        return EngineConfig.of(**(current | values))


_PARTS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "kernels": KernelConfig,
    "transfer": TransferConfig,
}


@dataclass(frozen=True)
class ServingConfig:
    """The frontend's own model settings: what clients call the model, the sampling defaults it applies and whether
    clients' priorities order their requests. Never sent to a worker."""

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
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: online requests are served first come, first served (batch requests after them) and one that sets a "
        "non-zero priority is refused (400); priority: the requests' priority field (an integer in [-1000000, "
        "1000000], default 0) orders their admission, lower first, and preemption, the least urgent first (as "
        "vLLM's); every batch request still comes after every online one and shares --batch-step-tokens of a step",
        choices=SCHEDULING_POLICIES,
    )

    def __post_init__(self) -> None:
        check_settings(self)


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
        min=0,
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
        above=0,
    )
    routing_temperature: float = setting(
        0.0, "kv_aware and least_load: 0 picks the cheapest worker; above 0 draws among near-equal ones", min=0
    )
    worker_timeout: float = setting(
        10.0,
        "seconds without a transport heartbeat (answered by the worker's I/O thread, also mid-step) after which a "
        "worker counts as down: killed, stopped or unreachable (its requests fail, others go on)",
        above=0,
    )
    worker_step_timeout: float = setting(
        300.0,
        "seconds a worker whose connection is alive may leave pings unanswered (its engine loop answers between "
        "steps) before it counts as hung and down",
        above=0,
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
    num_prefill_workers: int = setting(0, "disaggregated: prefill workers to start on this host", min=0)
    num_decode_workers: int = setting(0, "disaggregated: decode workers to start on this host", min=0)
    max_local_prefill_tokens: int = setting(
        256,
        "disaggregated: a decode worker prefills a request itself when the part of its prompt it does not hold "
        "is at most this many tokens (0: every request is prefilled by a prefill worker)",
        min=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)
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
