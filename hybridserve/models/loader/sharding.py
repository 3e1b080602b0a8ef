"""Which slice of each checkpoint tensor one rank of a tensor- / expert-parallel group loads.

A model class's `shard_plan` maps checkpoint-name patterns (`*` stands for one dotted segment of the name) to
a style:

- "colwise": dim 0 (a linear's output rows, and its bias) in `tp_size` equal parts, rank r the r-th;
- "rowwise": dim 1 (a linear's input columns) in equal parts; a 1-D tensor (a rowwise linear's bias) is
  replicated: the sharded layer adds it once, after the reduction;
- "vocab": dim 0 (embedding or lm_head rows) in parts of ceil(rows / tp_size), the last rank's shorter where
  tp_size does not divide the vocabulary: the sharded embedding pads its rows and masks the ids it lacks;
- "replicate": every rank reads the whole tensor;
- "expert": a routed expert's tensor (`.experts.<i>.` in its name) is read whole by the expert-parallel rank
  whose contiguous range of expert indices holds i (E experts over ep_size ranks: rank r holds
  [r * E / ep_size, (r + 1) * E / ep_size)), and by no other.

"colwise" and "rowwise" may name after a colon the config attributes counting the heads in the split
dimension ("colwise:num_key_value_heads"): a rank's part then holds whole heads, and every count must divide
by tp_size, even where the rows would (3 heads of 64 rows do not split over 2 ranks).

Policy: when loading a shard, every checkpoint tensor must match exactly one pattern, "replicate" included.
A tensor no pattern names, or one that two name, is an error, never a silent replica. The plan is read only
for sizes above 1: a whole load never consults it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from transformers import PretrainedConfig

STYLES = ("colwise", "rowwise", "vocab", "replicate", "expert")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")

# What a rank reads of one tensor: () the whole of it, else a slice per leading dimension (safetensors' get_slice).
Index = tuple[slice, ...]


@dataclass(frozen=True)
class Shard:
    """One rank's place in the tensor-parallel group and, for routed experts, in the expert-parallel group."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        for kind, rank, size in (("tensor", self.tp_rank, self.tp_size), ("expert", self.ep_rank, self.ep_size)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{kind}-parallel rank {rank} is not a rank of a group of size {size}")

    @property
    def whole(self) -> bool:
        """Whether this rank loads the whole checkpoint (both sizes 1)."""
        return self.tp_size == 1 and self.ep_size == 1


@dataclass(frozen=True)
class Rule:
    pattern: str
    style: str
    heads: tuple[tuple[str, int], ...]  # (config attribute, its value): the head counts of the split dimension


class ShardPlan:
    """A model class's shard_plan with its head counts read from the model's config."""

    def __init__(self, plan: Mapping[str, str], config: PretrainedConfig) -> None:
        self.rules: list[tuple[re.Pattern[str], Rule]] = []
        for pattern, spec in plan.items():
            style, _, attrs = spec.partition(":")
            if style not in STYLES:
                raise ValueError(f"shard plan rule {pattern!r}: unknown style {style!r}; known: {', '.join(STYLES)}")
            names = tuple(a for a in attrs.split(",") if a)
            if names and style not in ("colwise", "rowwise"):
                raise ValueError(f"shard plan rule {pattern!r}: only colwise and rowwise splits count heads")
            missing = [a for a in names if not isinstance(getattr(config, a, None), int)]
            if missing:
                raise ValueError(f"shard plan rule {pattern!r}: the config has no head count {missing}")
            regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
            self.rules.append((regex, Rule(pattern, style, tuple((a, getattr(config, a)) for a in names))))

    def rule(self, name: str) -> Rule:
        """The one rule for checkpoint tensor `name`; ValueError where none or several match."""
        hits = [rule for regex, rule in self.rules if regex.fullmatch(name)]
        if not hits:
            raise ValueError(f"checkpoint tensor {name} matches no rule of the shard plan (replicate included)")
        if len(hits) > 1:
            raise ValueError(
                f"checkpoint tensor {name} matches several rules of the shard plan: {[r.pattern for r in hits]}"
            )
        return hits[0]

    def indices(self, shapes: Mapping[str, list[int]], shard: Shard) -> dict[str, Index]:
        """What `shard` reads of each checkpoint tensor, by name, from every tensor's shape; the tensors it does
        not read at all (other ranks' experts) are left out. Raises ValueError before anything is read where a
        tensor has no rule or does not divide."""
        rules = {name: self.rule(name) for name in shapes}
        experts = _expert_counts(n for n, r in rules.items() if r.style == "expert")
        out: dict[str, Index] = {}
        for name, rule in rules.items():
            index = _index(name, shapes[name], rule, shard, experts)
            if index is not None:
                out[name] = index
        return out


def _expert(name: str) -> tuple[str, int]:
    """An expert tensor's name with its index starred (`...experts.*.w1.weight`), and the index."""
    match = _EXPERT.search(name)
    if match is None:
        raise ValueError(f"checkpoint tensor {name} is planned 'expert' but names no expert index")
    return _EXPERT.sub(".experts.*.", name, count=1), int(match.group(1))


def _expert_counts(names: Iterable[str]) -> dict[str, int]:
    """How many experts each starred expert name has, checked to be numbered 0..E-1."""
    seen: dict[str, set[int]] = {}
    for name in names:
        key, index = _expert(name)
        seen.setdefault(key, set()).add(index)
    for key, ids in seen.items():
        if ids != set(range(len(ids))):
            raise ValueError(f"the experts of {key} are not numbered 0..{len(ids) - 1}: {sorted(ids)}")
    return {key: len(ids) for key, ids in seen.items()}


def _indivisible(name: str, shape: list[int], style: str, count: int, unit: str, kind: str, size: int) -> ValueError:
    return ValueError(
        f"cannot split {name} of shape {list(shape)} {style} over {kind}-parallel size {size}: "
        f"{count} {unit} do not divide among {size} ranks"
    )


def _index(name: str, shape: list[int], rule: Rule, shard: Shard, experts: dict[str, int]) -> Index | None:
    style, size, rank = rule.style, shard.tp_size, shard.tp_rank
    if style == "replicate":
        return ()
    if style == "expert":
        key, index = _expert(name)
        count = experts[key]
        if count % shard.ep_size:
            raise _indivisible(name, shape, style, count, "experts", "expert", shard.ep_size)
        per = count // shard.ep_size
        return () if shard.ep_rank * per <= index < (shard.ep_rank + 1) * per else None
    if size == 1:
        return ()
    if style == "vocab":
        rows = shape[0]
        per = -(-rows // size)
        start = min(rank * per, rows)
        return (slice(start, min(start + per, rows)),)
    dim = 0 if style == "colwise" else 1
    if len(shape) <= dim:  # a rowwise linear's bias
        return ()
    for attr, heads in rule.heads:
        if heads % size:
            raise _indivisible(name, shape, style, heads, f"heads ({attr})", "tensor", size)
    extent = shape[dim]
    if extent % size:
        raise _indivisible(
            name, shape, style, extent, f"{'rows' if dim == 0 else 'columns'} (dim {dim})", "tensor", size
        )
    per = extent // size
    part = slice(rank * per, (rank + 1) * per)
    return (part,) if dim == 0 else (slice(None), part)
