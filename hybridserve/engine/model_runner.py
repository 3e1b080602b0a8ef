"""Loads the model and its paged cache, turns a scheduled step into tensors, runs it, samples."""

from __future__ import annotations

import logging
import mmap
import time
from pathlib import Path

import torch

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.state_pool import StatePool
from hybridserve.engine.cache.state_snapshots import StateSnapshots
from hybridserve.engine.sampler import Sampler, SampleResult, SamplingState
from hybridserve.engine.scheduler import SchedulerOutput
from hybridserve.engine.structured_output import GrammarBitmask, SequenceGrammar
from hybridserve.models.cache_specs import AttentionSpec, CacheLayout, LinearStateSpec
from hybridserve.models.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk, StateMetadata
from hybridserve.models.layers.linear import can_pack, pack_linears
from hybridserve.models.layers.native import (
    KernelUnavailable,
    PagedAttention,
    load_fused_ops,
    load_paged_attention,
    use_native_ops,
)
from hybridserve.models.layers.rope import RotaryEmbedding
from hybridserve.models.loader.safetensors import load_state_dict, pack
from hybridserve.models.registry import load_config, model_class, state_adapter

logger = logging.getLogger("hybridserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16 / AMX), else float32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU it is backed by an anonymous mapping, so pages cost memory only once
    written: a large KV cache does not take its full size in RAM until the blocks are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_dir: Path) -> None:
        self.device = choose_device(config.device)
        self.dtype = choose_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        t0 = time.perf_counter()
        self.hf_config = load_config(hf_dir)
        cls = model_class(self.hf_config)
        with torch.device("meta"):
            model = cls(self.hf_config)
        state = load_state_dict(hf_dir, self.dtype, self.device, getattr(model, "fp32_parameters", ()))
        # Old Llama checkpoints carry the rotary table; the model computes its own.
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        state = pack(state_adapter(cls)(state), model.packed_modules)
        unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
        if unexpected:
            raise ValueError(f"checkpoint {hf_dir} has parameters the model does not use: {unexpected[:5]}")
        if self.hf_config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"checkpoint {hf_dir} lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
        # Rotary tables were computed on the CPU while the rest was built on meta.
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.to(self.device, self.dtype)
        if can_pack(self.device):
            pack_linears(model)
        self.model = model.eval()
        self.vocab_size = self.hf_config.vocab_size
        self.max_position = self.hf_config.max_position_embeddings
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True) and window < self.max_position:
            # Attention here is full attention: within the window it equals sliding-window attention,
            # beyond it it would silently differ, so the context stops at the window.
            logger.warning("model uses sliding-window attention (%d tokens): context limited to %d", window, window)
            self.max_position = window
        logger.info("loaded %s (%s, %s) in %.1fs", hf_dir, self.device, self.dtype, time.perf_counter() - t0)

        self.layout = CacheLayout(model.cache_spec(config.block_size, self.dtype))
        self.num_blocks = config.num_kv_blocks or self.layout.num_blocks_for(config.kv_cache_memory_bytes)
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is smaller than one KV block "
                f"({self.layout.bytes_per_block} bytes)"
            )
        paged = iter([zeroed(s.shape(self.num_blocks), s.dtype, self.device) for s in self.layout.paged_specs])
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.layout.bytes_per_block / 1024**3,
        )
        self.state_pool: StatePool | None = None
        self.snapshots: StateSnapshots | None = None
        states = iter([])
        if self.layout.state_specs:
            slots = config.num_state_slots or config.max_num_seqs
            self.state_pool = StatePool(self.layout.state_specs, slots, self.device, zeroed)
            states = iter(self.state_pool.layers)
            logger.info("recurrent state: %d slots of %.2f MiB", slots, self.layout.bytes_per_state_slot / 1024**2)
            num_snapshots = slots if config.num_state_snapshots is None else config.num_state_snapshots
            if config.enable_prefix_caching and num_snapshots > 0:
                self.snapshots = StateSnapshots(self.state_pool, num_snapshots, self.device, zeroed)
                logger.info("recurrent-state snapshots for prefix hits: %d", num_snapshots)
        # Per layer, in layer order: a paged cache tensor, or a (conv tails, states) pair of the state pool.
        self.kv_caches = [
            next(states) if isinstance(s, LinearStateSpec) else next(paged) for s in self.layout.layer_specs
        ]
        self.attention_kernels: PagedAttention | None = None
        if config.native_kernels and self.device.type == "cpu":
            self._load_native_kernels()
        self.sampler = Sampler(self.vocab_size)
        self.sampling_states: dict[str, SamplingState] = {}
        self.grammar_bitmask = GrammarBitmask(self.vocab_size)

    def _load_native_kernels(self) -> None:
        """C kernels for this model on CPU: paged attention (decode, rotary + cache write) for its attention
        layers and the fused element-wise ops. Each falls back to PyTorch ops, with a warning naming why, if
        it cannot be built."""
        try:
            use_native_ops(self.model, load_fused_ops())
        except KernelUnavailable as exc:
            logger.warning("element-wise ops stay PyTorch ops: %s", exc)
        specs = {s for s in self.layout.paged_specs if isinstance(s, AttentionSpec)}
        if len(specs) != 1:
            return
        spec = specs.pop()
        heads = self.hf_config.num_attention_heads
        group = heads // (getattr(self.hf_config, "num_key_value_heads", None) or heads)
        try:
            self.attention_kernels = load_paged_attention(spec.dtype, spec.head_dim, spec.block_size, group)
        except KernelUnavailable as exc:
            logger.warning("paged attention falls back to PyTorch ops: %s", exc)
            return
        logger.info(
            "paged attention: native kernels (head_dim %d, %d query heads per KV head, %s%s)",
            spec.head_dim,
            group,
            spec.dtype,
            ", bf16 dot-product instructions" if self.attention_kernels.bf16_dot else "",
        )

    def release(self, request_id: str) -> None:
        self.sampling_states.pop(request_id, None)

    def attention_metadata(
        self, out: SchedulerOutput, block_tables: list[list[int]], state_slots: list[int] | None = None
    ) -> AttentionMetadata:
        """Cache slots, the decode group and the prefill chunks of a step, built once for every layer;
        with `state_slots` (one per scheduled request), the recurrent-state slots of each group."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_states: list[int] = []
        prefill_states: list[int] = []
        offset = 0
        for i, (s, table) in enumerate(zip(out.scheduled, block_tables, strict=True)):
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if state_slots is not None:
                (decode_states if n == 1 else prefill_states).append(state_slots[i])
            if n == 1:
                decode_rows.append(offset)
                decode_tables.append(table[: -(-(start + 1) // bs)])
                decode_lens.append(start + 1)
            elif start == 0:
                prefills.append(PrefillChunk(offset, offset + n, 0, None, None))
            else:
                length = start + n
                used = table[: -(-length // bs)]
                q_pos = torch.arange(start, length, device=dev).unsqueeze(1)
                mask = torch.arange(length, device=dev).unsqueeze(0) <= q_pos
                prefills.append(
                    PrefillChunk(offset, offset + n, start, torch.tensor(used, device=dev), mask.view(1, 1, n, length))
                )
            offset += n
        decode = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            bias = None  # the native kernel stops at each request's length by itself
            if self.attention_kernels is None:
                visible = torch.arange(width * bs, device=dev).unsqueeze(0) < lens.unsqueeze(1)
                bias = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
                bias = bias.unsqueeze(1)
            decode = DecodeGroup(torch.tensor(decode_rows, device=dev), tables, tables.flatten(), lens, bias)
        states = None
        if state_slots is not None:
            decode_slots = torch.tensor(decode_states, device=dev) if decode_states else None
            states = StateMetadata(decode_slots, prefill_states)
        return AttentionMetadata(torch.tensor(slots, device=dev), decode, prefills, states, self.attention_kernels)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: list[list[int]], state_slots: list[int] | None = None
    ) -> dict[str, SampleResult]:
        """Run one step; returns the sampled token of every request whose last known token was computed.
        `state_slots`: each scheduled request's recurrent-state slot (models with linear attention)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        states: list[SamplingState] = []
        grammars: list[tuple[int, SequenceGrammar]] = []  # (row among the sampled, its grammar)
        for s in out.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            ids.extend(req.token_ids_range(start, end))
            positions.extend(range(start, end))
            if s.samples:
                sample_rows.append(len(ids) - 1)
                state = self.sampling_states.get(req.request_id)
                if state is None:
                    state = SamplingState.create(
                        req.params, req.prompt_token_ids, req.output_token_ids, req.eos_token_ids, self.device
                    )
                    self.sampling_states[req.request_id] = state
                if req.grammar is not None:
                    grammars.append((len(states), req.grammar))
                states.append(state)
        meta = self.attention_metadata(out, block_tables, state_slots)
        hidden = self.model(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), self.kv_caches, meta
        )
        if not sample_rows:
            return {}
        # Filled on the CPU while a GPU still runs the step's kernels.
        mask = self.grammar_bitmask.fill(grammars, len(states), self.device) if grammars else None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        results = self.sampler(logits, states, mask)
        sampling = [s.request.request_id for s in out.scheduled if s.samples]
        return dict(zip(sampling, results, strict=True))
