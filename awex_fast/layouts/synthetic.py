"""Generated training and inference layouts for the named model shapes of `awex_fast.layouts.models`.

Why generated: planning benchmarks and `awex-fast plan` need the metadata a 256-rank Megatron
job or 128 vLLM ranks would report, on a machine that can run neither. Every layout is written
as `ShardRule` grids (one shared rule object per distinct placement), so a 1,024-rank layout of
a 70k-tensor MoE stays a few MB and the planner never sees expanded pieces.

Training (Megatron-style rank order, TP fastest): ``rank = base + ((pp * DP + dp) * FSDP + fsdp)
* TP + tp``. Dense tensors are split by TP on their `TensorSpec.tp_dim` (KV heads replicated
when TP exceeds them), by FSDP into dim-0 chunks (a TP split on dim 0 and FSDP compose into one
dim-0 split of TP x FSDP chunks, TP-major: the even-size approximation of FSDP2's
``_StridedShard``), and replicated over DP. Layers are spread over PP stages in contiguous
blocks (the first stages take one more when uneven); the embedding lives on stage 0, the final
norm and lm_head on the last. Routed experts: the DP x FSDP x TP ranks of a stage form
``EDP x EP x ETP`` (ETP fastest); expert ``e`` lives on EP rank ``e * EP // num_experts``, split by
ETP on its tp_dim, replicated over EDP.

Inference (vLLM-style): ``engines`` engines of ``tp`` ranks each, ``rank = base + engine * tp +
tp_rank``; dense tensors split by TP (vocab-parallel embedding and lm_head on dim 0, KV heads
replicated when TP exceeds them: rank r holds head ``r // (tp // kv_heads)``), other tensors
replicated; experts either TP-split inside each expert or, with ``ep``, whole on engine-local rank
``e * tp // num_experts``.

Spec strings (CLI and benchmarks): training ``"tp8,pp4,dp2"``, ``"fsdp64"``, ``"ep64,pp4"``
(DP defaults to what EP x ETP needs), ``"tp2,fsdp4,dp2,etp2"``; inference ``"tp8,engines8"``,
``"tp16,engines8,ep"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache

from awex_fast.layouts.models import ModelSpec, TensorSpec
from awex_fast.meta import ParameterMeta, ShardRule


@dataclass(frozen=True)
class TrainLayout:
    """Training parallelism: ``tp`` x ``fsdp`` x ``dp`` ranks per stage, ``pp`` stages; experts
    over ``ep`` x ``etp`` (x the remaining expert-data-parallel replicas)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    etp: int = 1
    dtype: str | None = None

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.tp * self.fsdp * self.dp

    @property
    def world_size(self) -> int:
        """Training ranks."""
        return self.stage_size * self.pp


@dataclass(frozen=True)
class InferLayout:
    """``engines`` inference engines of ``tp`` ranks; ``ep``: experts whole on one rank each."""

    tp: int = 1
    engines: int = 1
    ep: bool = False
    dtype: str | None = None

    @property
    def world_size(self) -> int:
        """Inference ranks."""
        return self.tp * self.engines


_TOKEN = re.compile(r"^(tp|pp|dp|fsdp|ep|etp|engines)(\d+)$")


def _tokens(spec: str) -> dict[str, int | bool]:
    out: dict[str, int | bool] = {}
    for tok in filter(None, (t.strip().lower() for t in spec.split(","))):
        m = _TOKEN.match(tok)
        if tok == "ep":
            out["ep"] = True
        elif tok.startswith("dtype="):
            continue
        elif m is None or int(m.group(2)) < 1:
            raise ValueError(f"bad layout token {tok!r} in {spec!r} (expected e.g. tp8, pp4, dp2)")
        else:
            out[m.group(1)] = int(m.group(2))
    return out


def _dtype(spec: str) -> str | None:
    for tok in spec.split(","):
        if tok.strip().lower().startswith("dtype="):
            return tok.strip()[6:]
    return None


def parse_train(spec: str) -> TrainLayout:
    """``"tp8,pp4,dp2"`` -> TrainLayout; without dp, DP is what EP x ETP needs (``"ep64,pp4"``
    is 64 ranks per stage). ``dtype=float32`` overrides the model's dtypes."""
    t = _tokens(spec)
    if "engines" in t or t.get("ep") is True:
        raise ValueError(f"training layout {spec!r}: 'engines' and a bare 'ep' are inference tokens")
    lay = TrainLayout(**{k: int(v) for k, v in t.items()}, dtype=_dtype(spec))
    need = lay.ep * lay.etp
    if "dp" not in t and need > lay.tp * lay.fsdp:
        if need % (lay.tp * lay.fsdp):
            raise ValueError(f"training layout {spec!r}: EP x ETP = {need} is not a multiple of TP x FSDP")
        lay = replace(lay, dp=need // (lay.tp * lay.fsdp))
    if lay.stage_size % (lay.ep * lay.etp):
        raise ValueError(
            f"training layout {spec!r}: EP x ETP = {lay.ep * lay.etp} must divide the "
            f"{lay.stage_size} ranks of a stage"
        )
    return lay


def parse_infer(spec: str) -> InferLayout:
    """``"tp16,engines8,ep"`` -> InferLayout (``dtype=float16`` overrides the model's dtypes)."""
    t = _tokens(spec)
    bad = set(t) - {"tp", "engines", "ep"}
    if bad or t.get("ep", True) is not True:
        raise ValueError(f"inference layout {spec!r}: only tp<N>, engines<N> and ep are allowed")
    return InferLayout(int(t.get("tp", 1)), int(t.get("engines", 1)), bool(t.get("ep", False)), _dtype(spec))


@cache
def _rule(ranks: tuple[int, ...], dims: tuple[int, ...], chunks: tuple[int, ...], replicas: int) -> ShardRule:
    # One object per distinct placement: build_plan and metas_to_json deduplicate by identity.
    return ShardRule(ranks, dims, chunks, replicas)


def _split(t: TensorSpec, n: int) -> tuple[int, int]:
    """(chunks along tp_dim, ranks sharing each chunk) for a TP degree ``n``."""
    if t.tp_dim is None or n == 1:
        return 1, n
    if t.kv_heads is not None and n > t.kv_heads:
        if n % t.kv_heads:
            raise ValueError(f"{t.name}: TP {n} is not a multiple of the {t.kv_heads} KV heads")
        return t.kv_heads, n // t.kv_heads
    return n, 1


def _stages(num_layers: int, pp: int) -> list[int]:
    """Stage of each decoder layer: contiguous blocks, the first stages one longer if uneven."""
    base, extra = divmod(num_layers, pp)
    out: list[int] = []
    for s in range(pp):
        out += [s] * (base + (s < extra))
    return out


def _dense_train(t: TensorSpec, lay: TrainLayout, stage_base: int) -> ShardRule:
    chunks, tp_rep = _split(t, lay.tp)  # tp_rep > 1: heads replicated over TP ranks
    F = lay.fsdp if t.shape else 1  # a 0-d tensor cannot be chunked: every FSDP rank has it
    frep = lay.fsdp // F

    def rank(dp: int, f: int, tp: int) -> int:
        return stage_base + (dp * lay.fsdp + f) * lay.tp + tp

    # Grid cells as (FSDP chunk f, TP chunk c); TP chunk c is held by TP ranks c * tp_rep + r.
    if chunks > 1 and F > 1 and t.tp_dim != 0:
        dims, nchunks = (0, t.tp_dim), (F, chunks)
        cells = [(f, c) for f in range(F) for c in range(chunks)]
    elif chunks > 1 and F > 1:  # TP and FSDP both on dim 0: one split, TP-major
        dims, nchunks = (0,), (chunks * F,)
        cells = [(f, c) for c in range(chunks) for f in range(F)]
    elif chunks > 1:
        dims, nchunks = (t.tp_dim,), (chunks,)
        cells = [(0, c) for c in range(chunks)]
    elif F > 1:
        dims, nchunks = (0,), (F,)
        cells = [(f, 0) for f in range(F)]
    else:
        dims, nchunks, cells = (), (), [(0, 0)]
    ranks = tuple(
        rank(dp, f + fr, c * tp_rep + r)
        for dp in range(lay.dp)
        for fr in range(frep)
        for r in range(tp_rep)
        for f, c in cells
    )
    return _rule(ranks, dims, nchunks, lay.dp * frep * tp_rep)


def _expert_train(t: TensorSpec, lay: TrainLayout, stage_base: int, num_experts: int) -> ShardRule:
    assert t.expert is not None
    edp = lay.stage_size // (lay.ep * lay.etp)
    ep_rank = t.expert * lay.ep // num_experts
    chunks = lay.etp if t.tp_dim is not None else 1
    rep = lay.etp // chunks
    ranks = tuple(
        stage_base + (j * lay.ep + ep_rank) * lay.etp + c + r
        for j in range(edp)
        for r in range(rep)
        for c in range(chunks)
    )
    dims = (t.tp_dim,) if chunks > 1 else ()
    return _rule(ranks, dims, (chunks,) if dims else (), edp * rep)


def training_metas(model: ModelSpec, layout: TrainLayout | str, base_rank: int = 0) -> list[ParameterMeta]:
    """Training-side metas of ``model`` under ``layout``, ranks starting at ``base_rank``."""
    lay = parse_train(layout) if isinstance(layout, str) else layout
    if model.num_layers < lay.pp:
        raise ValueError(f"{model.name}: {model.num_layers} layers cannot fill {lay.pp} pipeline stages")
    stage_of = _stages(model.num_layers, lay.pp)
    out = []
    for t in model.tensors:
        stage = 0 if t.layer < 0 else (lay.pp - 1 if t.layer >= model.num_layers else stage_of[t.layer])
        base = base_rank + stage * lay.stage_size
        if t.expert is not None:
            rule = _expert_train(t, lay, base, model.num_experts)
        else:
            rule = _dense_train(t, lay, base)
        out.append(ParameterMeta(t.name, t.shape, lay.dtype or t.dtype, (), (rule,)))
    return out


def _infer_rule(t: TensorSpec, lay: InferLayout, base_rank: int, num_experts: int) -> ShardRule:
    tp, E = lay.tp, lay.engines
    if t.expert is not None and lay.ep:
        owner = t.expert * tp // num_experts
        return _rule(tuple(base_rank + e * tp + owner for e in range(E)), (), (), E)
    chunks, rep = _split(t, tp)
    if not t.shape:
        chunks, rep = 1, tp
    ranks = tuple(
        base_rank + e * tp + c * rep + r for e in range(E) for r in range(rep) for c in range(chunks)
    )
    dims = (t.tp_dim,) if chunks > 1 and t.tp_dim is not None else ()
    return _rule(ranks, dims, (chunks,) if dims else (), E * rep)


def inference_metas(model: ModelSpec, layout: InferLayout | str, base_rank: int = 0) -> list[ParameterMeta]:
    """Inference-side metas of ``model`` under ``layout``, ranks starting at ``base_rank``."""
    lay = parse_infer(layout) if isinstance(layout, str) else layout
    E = model.num_experts
    return [
        ParameterMeta(t.name, t.shape, lay.dtype or t.dtype, (), (_infer_rule(t, lay, base_rank, E),))
        for t in model.tensors
    ]


def world_metas(
    model: ModelSpec, train: TrainLayout | str, infer: TrainLayout | InferLayout | str
) -> tuple[list[ParameterMeta], list[ParameterMeta]]:
    """(training metas, inference metas) in transfer ranks: inference ``0 .. I-1``, training
    ``I ..``."""
    ilay = parse_infer(infer) if isinstance(infer, str) else infer
    assert isinstance(ilay, InferLayout)
    return training_metas(model, train, base_rank=ilay.world_size), inference_metas(model, ilay)


__all__ = [
    "InferLayout",
    "TrainLayout",
    "inference_metas",
    "parse_infer",
    "parse_train",
    "training_metas",
    "world_metas",
]
