"""metas_from_dtensors against real DTensors in real gloo worlds, with two oracles per rank:

* the unsharded tensor built before sharding (same seed on every rank), and
* ``full_tensor()``;

each rank checks that every piece it reports, sliced out of the global tensor at
``global_offset``/``shape``, equals its local tensor at ``local_offset``, and that its pieces tile
its local tensor exactly. Rank 0 then gathers every rank's boxes (a fixed-size int64 table through
``all_gather``, no pickle) and checks that they cover each global tensor with the expected
multiplicity. One 4-rank world runs every case (spawning costs more than the cases); a second,
6-rank world covers the FSDP2 x TP corner that no 4-rank mesh reaches.
"""

from __future__ import annotations

import itertools
import math
import traceback

import pytest
import torch
from _dist import run_world
from hypothesis import given, settings
from hypothesis import strategies as st

from awex_fast.layouts.dtensor import _port_shard_order, _port_split, _torch_split, local_runs
from awex_fast.meta import MetadataError, ShardMeta, validate_metas

MAX_BOXES = 256
MAX_DIMS = 4
ROW = 2 + 3 * MAX_DIMS  # param index, ndim, offset[4], shape[4], local[4]


# ----------------------------------------------------------------------------- worker side
def _box_slice(offset, shape):
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _check_local(name, meta, local, oracles):
    """Pieces tile ``local`` exactly and equal the oracle slices."""
    assert tuple(meta.global_shape) == tuple(oracles[0].shape), name
    cover = torch.zeros(local.shape, dtype=torch.int32)
    for piece in meta.shards:
        lo = piece.local
        cover[_box_slice(lo, piece.shape)] += 1
        got = local[_box_slice(lo, piece.shape)]
        for oracle in oracles:
            want = oracle[_box_slice(piece.global_offset, piece.shape)]
            assert torch.equal(got, want), f"{name}: piece {piece} differs from the global tensor"
    assert bool((cover == 1).all()), f"{name}: pieces do not tile the local tensor {tuple(local.shape)}"


def _encode(metas, names):
    table = torch.full((MAX_BOXES, ROW), -1, dtype=torch.int64)
    row = 0
    for meta in metas:
        for piece in meta.shards:
            nd = len(piece.shape)
            table[row, 0], table[row, 1] = names.index(meta.name), nd
            table[row, 2 : 2 + nd] = torch.tensor(piece.global_offset, dtype=torch.int64)
            table[row, 2 + MAX_DIMS : 2 + MAX_DIMS + nd] = torch.tensor(piece.shape, dtype=torch.int64)
            table[row, 2 + 2 * MAX_DIMS : 2 + 2 * MAX_DIMS + nd] = torch.tensor(
                piece.local, dtype=torch.int64
            )
            row += 1
    return table


def _check_coverage(tables, names, shapes, multiplicity):
    counts = [torch.zeros(s, dtype=torch.int32) for s in shapes]
    for table in tables:
        for row in table.tolist():
            if row[0] < 0:
                continue
            nd = row[1]
            offset, shape = row[2 : 2 + nd], row[2 + MAX_DIMS : 2 + MAX_DIMS + nd]
            counts[row[0]][_box_slice(offset, shape)] += 1
    for name, count in zip(names, counts, strict=True):
        want = multiplicity(name)
        assert bool((count == want).all()), (
            f"{name}: coverage counts {sorted(set(count.flatten().tolist()))}, expected {want} everywhere"
        )


def _run_case(rank, world, build, multiplicity):
    """``build()`` returns (named tensors, {name: unsharded tensor}). Returns 'ok' or the error.
    Every collective (the build, full_tensor, the gathers) runs on every rank in the same order,
    whatever the checks find, so a wrong answer fails the case instead of hanging the world."""
    from torch.distributed.tensor import DTensor

    from awex_fast.layouts import metas_from_dtensors

    named, originals = build()
    names = list(named)
    fulls = {n: t.full_tensor().detach() for n, t in named.items() if isinstance(t, DTensor)}
    error = None
    metas = []
    try:
        metas = metas_from_dtensors(named, rank)
        assert [m.name for m in metas] == names
        validate_metas(metas)
        for meta in metas:
            t = named[meta.name]
            oracles = [originals[meta.name]] + ([fulls[meta.name]] if meta.name in fulls else [])
            local = t.to_local().detach() if isinstance(t, DTensor) else t.detach()
            assert meta.dtype == str(t.dtype).removeprefix("torch."), meta
            assert all(p.rank == rank for p in meta.shards), meta
            _check_local(meta.name, meta, local, oracles)
    except Exception:
        error = traceback.format_exc()
    shapes = [tuple(originals[n].shape) for n in names]
    tables = [torch.empty((MAX_BOXES, ROW), dtype=torch.int64) for _ in range(world)]
    torch.distributed.all_gather(tables, _encode(metas if error is None else [], names))
    failed = torch.tensor([0 if error is None else 1])
    torch.distributed.all_reduce(failed)
    if error is None and rank == 0 and int(failed) == 0:
        try:
            _check_coverage(tables, names, shapes, multiplicity)
        except Exception:
            error = traceback.format_exc()
    return error or "ok"


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Uneven over 4 ranks on purpose: vocab 50 -> 13,13,13,11; hidden 22 -> 6,6,6,4; mlp 30 rows.
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=22,
        intermediate_size=30,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, originals


def _case_fsdp2_qwen2(mesh_shape, names):
    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        model, originals = _tiny_qwen2()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return dict(model.named_parameters()), originals

    return build


class _Block(torch.nn.Module):
    """Colwise (14 rows, uneven for TP4), rowwise and an embedding, with biases."""

    def __init__(self, rows):
        super().__init__()
        torch.manual_seed(1)
        self.up = torch.nn.Linear(6, rows)
        self.down = torch.nn.Linear(rows, 6)
        self.embed = torch.nn.Embedding(13, 6)


def _case_tp(world):
    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        block = _Block(14)
        originals = {n: p.detach().clone() for n, p in block.named_parameters()}
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel(), "embed": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
        return dict(block.named_parameters()), originals

    return build


def _case_fsdp_tp(dp, tp, rows):
    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        block = _Block(rows)
        originals = {n: p.detach().clone() for n, p in block.named_parameters()}
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
        named = dict(block.named_parameters())
        # The case is only worth its name if FSDP2 really produced _StridedShard.
        assert isinstance(named["up.weight"].placements[0], _StridedShard), named["up.weight"].placements
        return named, originals

    return build


def _case_distribute(world):
    """distribute_tensor with explicit placements: uneven Shard on every dim, Replicate, 2-D
    meshes, _StridedShard that does not decode into a shard order (disjoint local boxes),
    flattening views of sharded tensors (disjoint boxes again), and a DTensor on a sub-mesh
    (global ranks 2 and 3) that ranks 0 and 1 are not part of."""

    def build():
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh1 = init_device_mesh("cpu", (world,))
        mesh2 = init_device_mesh("cpu", (2, world // 2))
        sub = DeviceMesh("cpu", [2, 3])
        gen = torch.Generator().manual_seed(2)
        originals = {
            "rows7": torch.randn(7, 3, generator=gen),
            "cols5": torch.randn(3, 5, generator=gen),
            "dim2": torch.randn(2, 3, 9, generator=gen),
            "rep": torch.randn(4, 4, generator=gen),
            "mesh2_s1_s0": torch.randn(9, 7, generator=gen),
            "mesh2_s0_s0": torch.randn(11, 2, generator=gen),
            "strided_1d": torch.randn(16, 3, generator=gen),
            "strided_rep": torch.randn(8, 2, generator=gen),
            "strided_cols": torch.randn(2, 12, generator=gen),
            "submesh": torch.randn(5, 2, generator=gen),
            "scalar": torch.randn((), generator=gen),
            "plain": torch.randn(3, 2, generator=gen).to(torch.bfloat16),
            "view_s1": torch.randn(4, 8, generator=gen),
            "view_s1s0": torch.randn(4, 8, generator=gen),
            "view_3d": torch.randn(2, 4, 4, generator=gen),
        }
        named = {
            "rows7": distribute_tensor(originals["rows7"], mesh1, [Shard(0)]),
            "cols5": distribute_tensor(originals["cols5"], mesh1, [Shard(1)]),
            "dim2": distribute_tensor(originals["dim2"], mesh1, [Shard(2)]),
            "rep": distribute_tensor(originals["rep"], mesh1, [Replicate()]),
            "mesh2_s1_s0": distribute_tensor(originals["mesh2_s1_s0"], mesh2, [Shard(1), Shard(0)]),
            "mesh2_s0_s0": distribute_tensor(originals["mesh2_s0_s0"], mesh2, [Shard(0), Shard(0)]),
            "strided_1d": distribute_tensor(
                originals["strided_1d"], mesh1, [_StridedShard(0, split_factor=2)]
            ),
            "strided_rep": distribute_tensor(
                originals["strided_rep"], mesh2, [_StridedShard(0, split_factor=2), Replicate()]
            ),
            "strided_cols": distribute_tensor(
                originals["strided_cols"], mesh2, [_StridedShard(1, split_factor=3), Shard(0)]
            ),
            "submesh": distribute_tensor(originals["submesh"], sub, [Shard(0)]),
            "scalar": distribute_tensor(originals["scalar"], mesh1, [Replicate()]),
            "plain": originals["plain"],
            # View ops give _StridedShard with its own split meaning (the spec says so).
            "view_s1": distribute_tensor(originals["view_s1"], mesh1, [Shard(1)]).view(32),
            "view_s1s0": distribute_tensor(originals["view_s1s0"], mesh2, [Shard(1), Shard(0)]).view(32),
            "view_3d": distribute_tensor(originals["view_3d"], mesh2, [Shard(1), Shard(2)]).view(2, 16),
        }
        originals["view_s1"] = originals["view_s1"].view(32)
        originals["view_s1s0"] = originals["view_s1s0"].view(32)
        originals["view_3d"] = originals["view_3d"].view(2, 16)
        return named, originals

    return build


def _distribute_multiplicity(world):
    rep = {"rep": world, "scalar": world, "strided_rep": world // 2, "plain": world, "strided_cols": 1}
    return lambda name: rep.get(name, 1)


def _partial_refused(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from awex_fast.layouts import metas_from_dtensors

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    dt = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
    try:
        metas_from_dtensors({"grad_like": dt}, rank)
    except MetadataError as exc:
        assert "grad_like" in str(exc) and "Partial" in str(exc), str(exc)
        return "ok"
    return "Partial DTensor was not refused"


def _shard_order_agrees(rank):
    """torch's shard-order decoding and this module's port agree on every placement mix of a
    3-D mesh (split factors 1..8)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from awex_fast.layouts import dtensor

    if dtensor._torch_shard_order is None:
        return "ok"
    mesh = init_device_mesh("cpu", (1, 2, 2))
    options = [Replicate(), Shard(0), Shard(1)] + [
        _StridedShard(d, split_factor=f) for d in (0, 1) for f in (2, 4)
    ]
    for combo in itertools.product(options, repeat=3):
        dims = [None if isinstance(p, Replicate) else p.dim for p in combo]
        sfs = [p.split_factor if isinstance(p, _StridedShard) else 1 for p in combo]
        ported = _port_shard_order(dims, sfs, mesh.shape)
        decoded = dtensor._torch_shard_order(combo, mesh)
        theirs = None if decoded is None else {e.tensor_dim: list(e.mesh_dims) for e in decoded}
        assert ported == theirs, (combo, ported, theirs)
    return "ok"


def world_main(rank, world):
    """Every 4-rank case; returns {case: 'ok' or the traceback} for this rank."""
    results = {}
    results["fsdp2_qwen2"] = _run_case(rank, world, _case_fsdp2_qwen2((world,), ("fsdp",)), lambda n: 1)
    # HSDP (replicate=2 x shard=2): every element on two ranks.
    results["hsdp_qwen2"] = _run_case(
        rank, world, _case_fsdp2_qwen2((2, world // 2), ("replicate", "shard")), lambda n: 2
    )
    results["tp_colwise_rowwise"] = _run_case(
        rank, world, _case_tp(world), lambda n: world if n == "down.bias" else 1
    )
    results["fsdp2_tp_strided"] = _run_case(rank, world, _case_fsdp_tp(2, world // 2, 14), _fsdp_tp_mult(2))
    results["distribute"] = _run_case(rank, world, _case_distribute(world), _distribute_multiplicity(world))
    for case, fn in (("partial_refused", _partial_refused), ("shard_order_port", _shard_order_agrees)):
        try:
            results[case] = fn(rank)
        except Exception:
            results[case] = traceback.format_exc()
    return results


def _fsdp_tp_mult(tp):
    # down.bias is Replicate over tp; embed is not TP-parallel, so FSDP2 shards it over dp only.
    return lambda name: tp if name in ("down.bias", "embed.weight") else 1


def corner_main(rank, world):
    """FSDP2 over TP2 with 7 and 9 rows on mesh (dp=3, tp=2): layouts where torch's
    compute_local_shape_and_global_offset misreports (see awex_fast/layouts/dtensor.py)."""
    return {
        f"fsdp2_tp_{rows}rows": _run_case(rank, world, _case_fsdp_tp(3, 2, rows), _fsdp_tp_mult(2))
        for rows in (7, 9)
    }


# ----------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def world4():
    return run_world(world_main, 4, timeout=240)


CASES = [
    "fsdp2_qwen2",
    "hsdp_qwen2",
    "tp_colwise_rowwise",
    "fsdp2_tp_strided",
    "distribute",
    "partial_refused",
]


@pytest.mark.parametrize("case", [*CASES, "shard_order_port"])
def test_dtensor_world4(world4, case):
    failures = {r: res[case] for r, res in enumerate(world4) if res[case] != "ok"}
    assert not failures, "\n".join(f"--- rank {r} ---\n{text}" for r, text in failures.items())


def test_fsdp2_tp_uneven_corner_6_ranks():
    results = run_world(corner_main, 6, timeout=240)
    failures = {(r, c): t for r, res in enumerate(results) for c, t in res.items() if t != "ok"}
    assert not failures, "\n".join(f"--- rank {r} {c} ---\n{t}" for (r, c), t in failures.items())


# ----------------------------------------------------------------------------- single process
def _pieces_for(global_shape, placements, mesh_shape, coord):
    from awex_fast.layouts.dtensor import _pieces

    return _pieces(0, local_runs("t", global_shape, placements, mesh_shape, coord))


def test_fsdp2_tp_corner_table():
    """FSDP2 x TP2 x 7 rows on mesh (dp=3, tp=2), as observed with torch 2.13 FSDP2 (rows per
    rank found by matching values against the unsharded weight); torch's own
    compute_local_shape_and_global_offset says (1 row at 6) for rank 4 and (0 rows) for rank 5."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = (_StridedShard(0, split_factor=2), Shard(0))
    want = {(0, 0): (0, 2), (0, 1): (4, 1), (1, 0): (2, 2), (1, 1): (5, 1), (2, 0): None, (2, 1): (6, 1)}
    for coord, box in want.items():
        pieces = _pieces_for((7, 4), placements, (3, 2), coord)
        if box is None:
            assert pieces == [], coord
        else:
            assert pieces == [ShardMeta(0, (box[0], 0), (box[1], 4))], (coord, pieces)


def _apply_split_tensor(tensor, placements, mesh_shape, coord):
    """distribute_tensor's semantics without a process group: each placement's own
    _split_tensor, left to right."""
    from torch.distributed.tensor import Replicate

    local = tensor
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        chunks, _ = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False, contiguous=True)
        local = chunks[coord[mesh_dim]]
    return local


@st.composite
def _strided_layouts(draw):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 13)) for _ in range(ndim))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3))))
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=draw(st.sampled_from([2, 3, 5]))))
    return shape, tuple(placements), mesh_shape


@settings(max_examples=60, deadline=None)
@given(_strided_layouts())
def test_split_semantics_match_torch(layout):
    """Where placements do not decode into a shard order, the pieces are exactly what the
    placements' own _split_tensor puts on each rank (including several disjoint boxes), and the
    port of that arithmetic agrees with torch's."""
    import awex_fast.layouts.dtensor as mod

    shape, placements, mesh_shape = layout
    dims = [None if not hasattr(p, "dim") else p.dim for p in placements]
    sfs = [getattr(p, "split_factor", 1) if hasattr(p, "dim") else 1 for p in placements]
    decodes = mod._port_shard_order(dims, sfs, mesh_shape) is not None
    full = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        pieces = _pieces_for(shape, placements, mesh_shape, coord)
        if decodes:
            # Plain nested chunks: one contiguous box per rank (or none).
            assert len(pieces) <= 1
            continue
        local = _apply_split_tensor(full, placements, mesh_shape, coord)
        cover = torch.zeros(local.shape, dtype=torch.int32)
        for p in pieces:
            box = _box_slice(p.local, p.shape)
            assert torch.equal(local[box], full[_box_slice(p.global_offset, p.shape)])
            cover[box] += 1
        assert bool((cover == 1).all())
        for mesh_dim, p in enumerate(placements):
            if hasattr(p, "dim"):
                idx = list(range(shape[p.dim]))
                n, c = mesh_shape[mesh_dim], coord[mesh_dim]
                assert _torch_split(p, p.dim, idx, n, c) == _port_split(p, idx, n, c)
