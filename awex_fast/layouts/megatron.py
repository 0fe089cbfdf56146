"""Rule-based training layouts that are not DTensors: Megatron-style TP, PP, CP/DP, EP.

Why rules: a Megatron job's pieces are a regular grid (TP chunks, replicated over DP), so one
`ShardRule` per parameter describes every rank's piece, and one rule object is shared by every
parameter with the same placement. A 70k-tensor, 256-rank MoE layout then builds in well under
a second and stays small as JSON; the planner expands rules natively.

Rank order (`ParallelLayout.order`, Megatron's ``RankGenerator``): ranks are numbered with the
first name of ``order`` fastest. With Megatron's default ``"tp-cp-ep-dp-pp"``::

    dense params:  rank = tp + TP * (cp + CP * (dp + DP * pp))            (ep = 1)
    expert params: rank = etp + ETP * (ep + EP * (edp + EDP * pp))        (cp = 1)

where the expert grid re-partitions each stage's TP x CP x DP ranks as ETP x EP x EDP
(``EDP = TP * CP * DP / (ETP * EP)``, ETP defaulting to TP), as Megatron-core's
``initialize_model_parallel`` does with its two rank generators. Any permutation of the five
names works; names left out must have size 1 and are appended.

Placement of canonical (Hugging Face) names, `megatron_style`:

* column-parallel (TP splits dim 0): ``q/k/v_proj`` weight and bias, ``gate_proj`` / ``up_proj``
  weight and bias (dense MLP and shared experts);
* row-parallel (TP splits dim 1): ``o_proj.weight``, ``down_proj.weight``;
* vocab-parallel: ``model.embed_tokens.weight`` (first stage) and ``lm_head.weight`` (last
  stage), TP splitting rows of the vocabulary padded to a multiple of ``vocab_divisible_by *
  tp`` (Megatron's ``make_vocab_size_divisible_by``, 128); with tied embeddings and PP > 1 the
  last stage holds a replica of the embedding, as Megatron keeps one for its output layer;
* replicated: norms, biases of row-parallel layers, the router ``mlp.gate.weight``,
  ``shared_expert_gate``, ``e_score_correction_bias``;
* experts ``mlp.experts.{e}.*``: expert ``e`` on EP rank ``e // (E / EP)`` (contiguous blocks,
  Megatron's local experts), split inside by ETP like the dense MLP, replicated over EDP; the
  stacked transformers-5 tensors ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``mlp.experts.down_proj`` ``[E, H, I]`` are split by EP on dim 0 and by ETP on the I dim; for
  ``gate_up_proj`` each rank holds ``[gate_r | up_r]`` (Megatron's GLU fc1 layout), two pieces.

Layers go to pipeline stages in contiguous blocks (`ParallelLayout.layer_stages`): evenly, or
with ``first_stage_layers`` / ``last_stage_layers`` and the rest even over the middle stages, or
interleaved over ``vpp`` virtual stages (chunk ``c`` of ``pp * vpp`` on stage ``c % pp``).

With ``interleaved_qkv=(num_heads, num_kv_heads, head_dim)``, q/k/v are pieces of Megatron's
``linear_qkv`` local tensor, interleaved per query group ``[q_g | k_g | v_g]``: the canonical
q/k/v names all view that whole local tensor, and each local group is one piece at its
``local_offset``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from awex_fast.meta import ParameterMeta, ShardMeta, ShardRule

__all__ = ["MEGATRON_ORDER", "STYLES", "ParallelLayout", "megatron_metas", "megatron_style", "world_ranks"]

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
_NAMES = ("tp", "cp", "ep", "dp", "pp")

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
EXPERT_COLUMN, EXPERT_ROW = "expert_column", "expert_row"
STACKED_GATE_UP, STACKED_DOWN = "stacked_gate_up", "stacked_down"
STYLES = (COLUMN, ROW, VOCAB, REPLICATED, EXPERT_COLUMN, EXPERT_ROW, STACKED_GATE_UP, STACKED_DOWN)


@dataclass(frozen=True)
class ParallelLayout:
    """A Megatron job's parallel sizes and rank order (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = MEGATRON_ORDER
    vpp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "cp", "ep", "vpp"):
            if getattr(self, key) < 1:
                raise ValueError(f"ParallelLayout.{key} must be >= 1, got {getattr(self, key)}")
        names = self.order.split("-")
        if len(set(names)) != len(names) or not set(names) <= set(_NAMES):
            raise ValueError(f"ParallelLayout.order {self.order!r} must be distinct names from {_NAMES}")
        for key in _NAMES:
            if key not in names and getattr(self, key) > 1:
                raise ValueError(
                    f"ParallelLayout.order {self.order!r} omits {key}, whose size is {getattr(self, key)}"
                )
        if self.etp is not None and self.etp < 1:
            raise ValueError(f"ParallelLayout.etp must be >= 1, got {self.etp}")
        if (self.tp * self.cp * self.dp) % (self.expert_tp * self.ep):
            raise ValueError(
                f"ETP x EP = {self.expert_tp} x {self.ep} must divide TP x CP x DP = "
                f"{self.tp * self.cp * self.dp} (the ranks of a stage)"
            )

    @property
    def expert_tp(self) -> int:
        """Tensor parallelism inside an expert (Megatron's default: the dense TP)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert piece within a stage."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def world_size(self) -> int:
        """Ranks of the job."""
        return self.tp * self.cp * self.dp * self.pp

    def _strides(self, sizes: Mapping[str, int]) -> dict[str, int]:
        names = self.order.split("-") + [k for k in _NAMES if k not in self.order.split("-")]
        strides, step = {}, 1
        for key in names:
            strides[key] = step
            step *= sizes[key]
        return strides

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank of a dense-grid coordinate."""
        sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        coord = {"tp": tp, "cp": cp, "ep": 0, "dp": dp, "pp": pp}
        return self._linear(sizes, coord)

    def expert_rank(self, *, etp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """Global rank of an expert-grid coordinate."""
        sizes = {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        coord = {"tp": etp, "cp": 0, "ep": ep, "dp": edp, "pp": pp}
        return self._linear(sizes, coord)

    def _linear(self, sizes: Mapping[str, int], coord: Mapping[str, int]) -> int:
        for key, value in coord.items():
            if not 0 <= value < sizes[key]:
                raise ValueError(f"coordinate {key}={value} is outside [0, {sizes[key]})")
        strides = self._strides(sizes)
        return sum(coord[k] * strides[k] for k in _NAMES)

    def layer_stages(self, num_layers: int) -> list[int]:
        """Pipeline stage of each decoder layer."""
        pp, vpp = self.pp, self.vpp
        first, last = self.first_stage_layers, self.last_stage_layers
        if vpp > 1:
            if first is not None or last is not None:
                raise ValueError(
                    "uneven first/last stages and virtual pipeline stages together are not supported"
                )
            if num_layers % (pp * vpp):
                raise ValueError(f"num_layers={num_layers} is not divisible by pp x vpp = {pp * vpp}")
            chunk = num_layers // (pp * vpp)
            return [(i // chunk) % pp for i in range(num_layers)]
        counts = [0] * pp
        rest, middle = num_layers, list(range(pp))
        for stage, n in ((0, first), (pp - 1, last)):
            if n is not None and pp > 1:
                counts[stage] = n
                rest -= n
                middle.remove(stage)
        if rest < 0 or (middle and rest % len(middle)) or (not middle and rest):
            raise ValueError(
                f"num_layers={num_layers} cannot be split over pp={pp} stages "
                f"(first={first}, last={last}, the rest evenly)"
            )
        for stage in middle:
            counts[stage] = rest // len(middle)
        return [s for s, n in enumerate(counts) for _ in range(n)]

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank of pipeline stage ``stage``, ascending."""
        return sorted(
            self.rank(tp=t, cp=c, dp=d, pp=stage)
            for t, c, d in itertools.product(range(self.tp), range(self.cp), range(self.dp))
        )


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_COLUMN = re.compile(r"^(self_attn\.(q|k|v)_proj|mlp\.(shared_experts?\.)?(gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"^(self_attn\.o_proj|mlp\.(shared_experts?\.)?down_proj)\.weight$")
_REPLICATED = re.compile(
    r"^(input_layernorm|post_attention_layernorm|self_attn\.(q|k)_norm|mlp\.gate|mlp\.shared_expert_gate)\.weight$"
    r"|^(self_attn\.o_proj|mlp\.(shared_experts?\.)?down_proj)\.bias$|^mlp\.gate\.e_score_correction_bias$"
)


def megatron_style(name: str) -> tuple[str, int | None, int | None]:
    """(style, decoder layer or None, routed expert or None) of a canonical name; styles are
    `STYLES`. Raises ValueError for a name Megatron's layout rules do not cover."""
    if name == "model.embed_tokens.weight":
        return VOCAB, None, None
    if name == "lm_head.weight":
        return VOCAB, None, None
    if name == "model.norm.weight":
        return REPLICATED, None, None
    m = _LAYER.match(name)
    if m is not None:
        layer, rest = int(m.group(1)), m.group(2)
        e = _EXPERT.match(rest)
        if e is not None:
            return (EXPERT_ROW if e.group(2) == "down_proj" else EXPERT_COLUMN), layer, int(e.group(1))
        if rest == "mlp.experts.gate_up_proj":
            return STACKED_GATE_UP, layer, None
        if rest == "mlp.experts.down_proj":
            return STACKED_DOWN, layer, None
        if _COLUMN.match(rest):
            return COLUMN, layer, None
        if _ROW.match(rest):
            return ROW, layer, None
        if _REPLICATED.match(rest):
            return REPLICATED, layer, None
    raise ValueError(f"parameter {name!r} has no Megatron placement rule; pass styles={{name: style}}")


class _Builder:
    """Shares one ShardRule object per distinct placement (the planner and the JSON encoder
    deduplicate rules by identity)."""

    def __init__(self, layout: ParallelLayout, num_layers: int) -> None:
        self.lay = layout
        self.stages = layout.layer_stages(num_layers) if num_layers else []
        self.cache: dict[tuple, ShardRule] = {}

    def _dense_ranks(self, stage: int) -> list[int]:
        lay = self.lay
        return [
            lay.rank(tp=t, cp=c, dp=d, pp=stage)
            for d, c, t in itertools.product(range(lay.dp), range(lay.cp), range(lay.tp))
        ]

    def dense(self, style: str, stage: int) -> ShardRule:
        key = (style, stage)
        rule = self.cache.get(key)
        if rule is None:
            ranks, tp = self._dense_ranks(stage), self.lay.tp
            if style == REPLICATED:
                rule = ShardRule(sorted(ranks), (), (), len(ranks))
            else:
                rule = ShardRule(ranks, (0 if style == COLUMN else 1,), (tp,), len(ranks) // tp)
            self.cache[key] = rule
        return rule

    def expert(self, style: str, stage: int, ep_rank: int) -> ShardRule:
        key = (style, stage, ep_rank)
        rule = self.cache.get(key)
        if rule is None:
            lay = self.lay
            ranks = [
                lay.expert_rank(etp=t, ep=ep_rank, edp=j, pp=stage)
                for j, t in itertools.product(range(lay.expert_dp), range(lay.expert_tp))
            ]
            dim = 0 if style == EXPERT_COLUMN else 1
            rule = ShardRule(ranks, (dim,), (lay.expert_tp,), lay.expert_dp)
            self.cache[key] = rule
        return rule

    def stacked_down(self, stage: int) -> ShardRule:
        key = (STACKED_DOWN, stage)
        rule = self.cache.get(key)
        if rule is None:
            lay = self.lay
            ranks = [
                lay.expert_rank(etp=t, ep=e, edp=j, pp=stage)
                for j, e, t in itertools.product(range(lay.expert_dp), range(lay.ep), range(lay.expert_tp))
            ]
            rule = ShardRule(ranks, (0, 2), (lay.ep, lay.expert_tp), lay.expert_dp)
            self.cache[key] = rule
        return rule


def _divisible(name: str, size: int, by: int, what: str) -> int:
    if size % by:
        raise ValueError(f"parameter {name!r}: dim of size {size} is not divisible by {what}={by}")
    return size // by


def _items(named_shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]]) -> list:
    items = list(named_shapes.items()) if isinstance(named_shapes, Mapping) else list(named_shapes)
    return [(name, tuple(int(s) for s in shape)) for name, shape in items]


def megatron_metas(
    named_shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]],
    layout: ParallelLayout,
    *,
    dtype: str | Mapping[str, str] = "bfloat16",
    num_layers: int | None = None,
    num_experts: int | None = None,
    tie_word_embeddings: bool = False,
    vocab_divisible_by: int = 128,
    interleaved_qkv: tuple[int, int, int] | None = None,
    styles: Mapping[str, str] | Callable[[str], str | None] | None = None,
) -> list[ParameterMeta]:
    """`ParameterMeta` for every canonical name of a Megatron job laid out as ``layout``, for the
    whole side at once (ranks are the job's global ranks).

    ``named_shapes``: canonical name -> global shape (a dict or pairs, in model order).
    ``dtype``: one name for all, or per name. ``num_layers`` / ``num_experts``: inferred from the
    names when omitted. ``styles`` overrides `megatron_style` for some names (a dict, or a
    function returning a style or None). Raises ValueError naming the parameter when a split
    is not exact (Megatron requires divisibility) or a name has no rule.
    """
    parsed = _parse_styles(_items(named_shapes), styles)
    layers = [p[3] for p in parsed if p[3] is not None]
    num_layers = (max(layers) + 1 if layers else 0) if num_layers is None else num_layers
    if num_experts is None:
        experts = [p[4] for p in parsed if p[4] is not None]
        stacked = [p[1][0] for p in parsed if p[2] in (STACKED_GATE_UP, STACKED_DOWN)]
        num_experts = max([e + 1 for e in experts] + stacked + [0])
    per_ep = _divisible("mlp.experts (routed experts)", num_experts, layout.ep, "ep") if num_experts else 1
    builder = _Builder(layout, num_layers)
    last = layout.pp - 1
    out = []
    for name, shape, style, layer, expert in parsed:
        dt = dtype if isinstance(dtype, str) else dtype[name]
        if layer is not None:
            stage = builder.stages[layer]
        else:
            stage = 0 if name == "model.embed_tokens.weight" else last
        if style == VOCAB:
            stages = [stage] + (
                [last] if tie_word_embeddings and name == "model.embed_tokens.weight" and last else []
            )
            shards = tuple(s for st in stages for s in _vocab_pieces(shape, layout, st, vocab_divisible_by))
            out.append(ParameterMeta(name, shape, dt, shards, ()))
            continue
        shards, rules = _pieces_or_rules(name, shape, style, stage, expert, layout, builder, per_ep,
                                         interleaved_qkv)
        out.append(ParameterMeta(name, shape, dt, shards, rules))
    return out


def _parse_styles(items: list[tuple[str, Sequence[int]]],
                  styles: Mapping[str, str] | Callable[[str], str | None] | None) -> list[tuple]:
    """(name, shape, style, layer or None, expert or None) of each name, ``styles`` first."""
    parsed = []
    for name, shape in items:
        style = None
        if styles is not None:
            style = styles.get(name) if isinstance(styles, Mapping) else styles(name)
        if style is None:
            parsed.append((name, shape, *megatron_style(name)))
            continue
        if style not in STYLES:
            raise ValueError(f"parameter {name!r}: unknown style {style!r}; expected one of {STYLES}")
        m = _LAYER.match(name)
        e = _EXPERT.match(m.group(2)) if m else None
        parsed.append((name, shape, style, int(m.group(1)) if m else None, int(e.group(1)) if e else None))
    return parsed


def _pieces_or_rules(name: str, shape: Sequence[int], style: str, stage: int, expert: int | None,
                     lay: ParallelLayout, builder: _Builder, per_ep: int,
                     interleaved_qkv: tuple[int, int, int] | None,
                     ) -> tuple[tuple[ShardMeta, ...], tuple[ShardRule, ...]]:
    """The explicit pieces or the rules of one non-vocab parameter of style ``style``."""
    if style in (COLUMN, ROW) and interleaved_qkv is not None and re.search(r"self_attn\.[qkv]_proj\.", name):
        return _interleaved_qkv_pieces(name, shape, lay, stage, interleaved_qkv), ()
    if style in (COLUMN, ROW):
        _divisible(name, shape[0 if style == COLUMN else 1], lay.tp, "tp")
        return (), (builder.dense(style, stage),)
    if style == REPLICATED:
        return (), (builder.dense(REPLICATED, stage),)
    if style in (EXPERT_COLUMN, EXPERT_ROW):
        if expert is None:
            raise ValueError(f"parameter {name!r}: style {style} needs an expert index in the name")
        _divisible(name, shape[0 if style == EXPERT_COLUMN else 1], lay.expert_tp, "etp")
        return (), (builder.expert(style, stage, expert // per_ep),)
    if style == STACKED_DOWN:
        _divisible(name, shape[0], lay.ep, "ep")
        _divisible(name, shape[2], lay.expert_tp, "etp")
        return (), (builder.stacked_down(stage),)
    return _stacked_gate_up_pieces(name, shape, lay, stage), ()  # STACKED_GATE_UP


def _vocab_pieces(
    shape: tuple[int, ...], lay: ParallelLayout, stage: int, divisible_by: int
) -> list[ShardMeta]:
    """Megatron's VocabParallelEmbedding: rows of the vocabulary padded to a multiple of
    ``divisible_by * tp``, ``padded / tp`` per TP rank, padding rows dropped."""
    vocab, rest = shape[0], shape[1:]
    step = divisible_by * lay.tp
    per = -(-vocab // step) * step // lay.tp
    out = []
    for d, c, t in itertools.product(range(lay.dp), range(lay.cp), range(lay.tp)):
        start = t * per
        rows = min(per, vocab - start)
        if rows > 0:
            rank = lay.rank(tp=t, cp=c, dp=d, pp=stage)
            out.append(ShardMeta(rank, (start,) + (0,) * len(rest), (rows, *rest)))
    return out


def _interleaved_qkv_pieces(
    name: str, shape: tuple[int, ...], lay: ParallelLayout, stage: int, heads: tuple[int, int, int]
) -> tuple[ShardMeta, ...]:
    """Pieces of canonical q/k/v inside Megatron's local ``linear_qkv`` ``[G_local * (qpg + 2)
    * hd, ...]``, interleaved per query group ``g`` as ``[q_g | k_g | v_g]``."""
    num_heads, groups, hd = heads
    qpg = _divisible(name, num_heads, groups, "num_query_groups")
    local_groups = _divisible(name, groups, lay.tp, "tp (over num_query_groups)")
    kind = re.search(r"self_attn\.([qkv])_proj\.", name).group(1)  # type: ignore[union-attr]
    rows = qpg * hd if kind == "q" else hd
    within = {"q": 0, "k": qpg * hd, "v": (qpg + 1) * hd}[kind]
    if shape[0] != groups * rows:
        raise ValueError(f"parameter {name!r}: {shape[0]} rows, but {groups} groups x {rows} rows expected")
    rest = shape[1:]
    out = []
    for d, c, t in itertools.product(range(lay.dp), range(lay.cp), range(lay.tp)):
        rank = lay.rank(tp=t, cp=c, dp=d, pp=stage)
        for k in range(local_groups):
            g = t * local_groups + k
            local = (k * (qpg + 2) * hd + within,) + (0,) * len(rest)
            out.append(ShardMeta(rank, (g * rows,) + (0,) * len(rest), (rows, *rest), local))
    return tuple(out)


def _stacked_gate_up_pieces(
    name: str, shape: tuple[int, ...], lay: ParallelLayout, stage: int
) -> tuple[ShardMeta, ...]:
    """``[E, 2I, H]``: EP splits experts, ETP splits I; each rank's local tensor is
    ``[E_local, 2 * I_r, H]`` = ``[gate_r | up_r]`` per expert."""
    experts, two_inter, hidden = shape
    inter = _divisible(name, two_inter, 2, "2 (gate and up halves)")
    per_ep = _divisible(name, experts, lay.ep, "ep")
    ir = _divisible(name, inter, lay.expert_tp, "etp")
    out = []
    for j, e, t in itertools.product(range(lay.expert_dp), range(lay.ep), range(lay.expert_tp)):
        rank = lay.expert_rank(etp=t, ep=e, edp=j, pp=stage)
        box = (per_ep, ir, hidden)
        out.append(ShardMeta(rank, (e * per_ep, t * ir, 0), box))
        out.append(ShardMeta(rank, (e * per_ep, inter + t * ir, 0), box, (0, ir, 0)))
    return tuple(out)


def world_ranks(layout: ParallelLayout) -> list[int]:
    """Every rank of the dense grid, ascending: ``range(world_size)`` for any valid order."""
    return sorted(
        layout.rank(tp=t, cp=c, dp=d, pp=p)
        for t, c, d, p in itertools.product(
            range(layout.tp), range(layout.cp), range(layout.dp), range(layout.pp)
        )
    )
