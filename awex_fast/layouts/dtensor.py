"""Exact shard pieces of DTensors: FSDP2, TP, 2-D FSDP2 x TP, HSDP, uneven chunks, `_StridedShard`.

Why not `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: it returns one
box (a shape and the offset of the first element), and for `_StridedShard` that box can be wrong.
Seen on torch 2.13:

* ``_StridedShard(0, sf=2)`` alone, 8 rows over 2 ranks: rank 0 holds rows {0, 1, 4, 5}, which is
  two boxes; torch reports the single box rows 0-3.
* FSDP2 over a TP-colwise weight, 7 rows, mesh (dp=3, tp=2), placements
  ``(_StridedShard(0, sf=2), Shard(0))``: FSDP2 chunks each TP rank's 4- or 3-row local tensor
  in 3, so rank (dp=2, tp=0) holds no row and rank (dp=2, tp=1) holds row 6. torch reports one
  row at offset 6 for the first and an empty box for the second. ``full_tensor()`` is right,
  because redistribution decodes the placements into a *shard order* first.

So this module follows the meanings torch itself gives `_StridedShard`:

0. Where the DTensor's spec records its own shard order (recent torch: specs built with
   ``use_strided_shard_as_shard_order=False``, as view ops build them), each tensor dim is
   split mesh dim after mesh dim in that order, every placement with its own split.
1. Otherwise, when the placements decode into a shard order (every ``split_factor`` equals the
   product of the mesh sizes of the shardings applied before it; FSDP2 always produces such
   placements), each tensor dim is chunked mesh dim after mesh dim *in that order*, torch.chunk
   arithmetic each time. This is what FSDP2 stores and what ``full_tensor()`` assumes. The
   decoding is torch's ``DTensorSpec._maybe_convert_StridedShard_to_shard_order`` where it
   exists (torch 2.13), else a port of it. Every piece is then one contiguous box.
2. Otherwise (e.g. ``_StridedShard(0, sf=2)`` on a 1-D mesh) each placement is applied left to
   right with the placement's own ``_split_tensor`` on an index tensor, the same call torch uses
   to scatter and to gather such tensors, with a port of the arithmetic where the private method
   is missing.

Under 0 and 2 a rank may hold several disjoint boxes of one tensor (a ``.view(-1)`` of a
column-sharded weight): each is reported as its own `ShardMeta` with the ``local_offset`` where
it sits in the local tensor.

Every result is checked against the shape of the rank's real local tensor; a mismatch raises
`MetadataError` instead of reporting pieces the rank does not hold.

Private torch API used, each guarded (absent -> the port or the placements alone):
``torch.distributed.tensor.placement_types._StridedShard`` (its ``dim``, ``split_factor`` and
``_split_tensor``), ``torch.distributed.tensor._dtensor_spec.DTensorSpec.
_maybe_convert_StridedShard_to_shard_order``, and ``DTensor._spec``'s
``use_strided_shard_as_shard_order`` and ``shard_order``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta, chunk_bounds

try:  # private; present on torch 2.5+ (the GPU machine's 2.11 and 2.13 here)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch without _StridedShard cannot produce one
    _StridedShard = None

try:  # private; recent torch (2.13 here) decodes _StridedShard into a shard order
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as _DTensorSpec

    _torch_shard_order = getattr(_DTensorSpec, "_maybe_convert_StridedShard_to_shard_order", None)
except ImportError:  # pragma: no cover - depends on the torch version
    _torch_shard_order = None

# A run of consecutive global indices along one dim: (local start, global start, length).
Run = tuple[int, int, int]


def _is_strided(placement: Any) -> bool:
    # Checked before Shard: on older torch _StridedShard subclasses Shard.
    return _StridedShard is not None and isinstance(placement, _StridedShard)


def _split_factor(placement: Any) -> int:
    return int(placement.split_factor) if _is_strided(placement) else 1


def _norm_dim(placement: Any, ndim: int, name: str) -> int:
    dim = int(placement.dim)
    dim = dim + ndim if dim < 0 else dim
    if not 0 <= dim < ndim:
        raise MetadataError(
            f"parameter {name!r}: placement {placement} shards dim {dim} of a {ndim}-D tensor"
        )
    return dim


def _port_shard_order(
    shard_dims: Sequence[int | None], split_factors: Sequence[int], mesh_shape: Sequence[int]
) -> dict[int, list[int]] | None:
    """Port of torch's `_maybe_convert_StridedShard_to_shard_order`: walk the mesh dims right to
    left and insert each sharding of tensor dim d where the product of the mesh sizes already
    ordered before it equals its split factor. None when some split factor fits nowhere."""
    orders: dict[int, list[int]] = {}
    for mesh_dim in reversed(range(len(shard_dims))):
        dim = shard_dims[mesh_dim]
        if dim is None:
            continue
        order = orders.setdefault(dim, [])
        acc = 1
        for i in range(len(order) + 1):
            if acc == split_factors[mesh_dim]:
                order.insert(i, mesh_dim)
                break
            if i < len(order):
                acc *= mesh_shape[order[i]]
        else:
            return None
    return orders


def _shard_order(
    placements: Sequence[Any],
    shard_dims: Sequence[int | None],
    mesh: Any,
    mesh_shape: Sequence[int],
) -> dict[int, list[int]] | None:
    """Tensor dim -> mesh dims in the order their chunking applies, or None if the placements do
    not decode into a shard order (then `_StridedShard` means its own `_split_tensor`)."""
    split_factors = [
        _split_factor(p) if d is not None else 1 for p, d in zip(placements, shard_dims, strict=True)
    ]
    if all(sf == 1 for sf in split_factors):
        orders: dict[int, list[int]] = {}
        for mesh_dim, dim in enumerate(shard_dims):
            if dim is not None:
                orders.setdefault(dim, []).append(mesh_dim)
        return orders
    normalized = all(d is None or int(p.dim) == d for p, d in zip(placements, shard_dims, strict=True))
    if _torch_shard_order is not None and mesh is not None and normalized:
        try:
            decoded = _torch_shard_order(tuple(placements), mesh)
        except (TypeError, AttributeError):  # signature drift: use the port below
            pass
        else:
            return None if decoded is None else {e.tensor_dim: list(e.mesh_dims) for e in decoded}
    return _port_shard_order(shard_dims, split_factors, mesh_shape)


def _runs_from_indices(indices: Sequence[int]) -> list[Run]:
    runs: list[Run] = []
    for local, glob in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == glob:
            lo, go, n = runs[-1]
            runs[-1] = (lo, go, n + 1)
        else:
            runs.append((local, glob, 1))
    return runs


def _port_split(placement: Any, indices: list[int], num_chunks: int, coord: int) -> list[int]:
    """The index arithmetic of ``Shard._split_tensor`` / ``_StridedShard._split_tensor``:
    torch.chunk into ``num_chunks`` (after a first torch.chunk into ``split_factor`` pieces and
    concatenating chunk ``coord`` of each piece, for `_StridedShard`)."""
    pieces = [indices]
    if _is_strided(placement):
        sf = _split_factor(placement)
        pieces = [indices[slice(*chunk_bounds(len(indices), sf, j))] for j in range(sf)]
    out: list[int] = []
    for piece in pieces:
        out.extend(piece[slice(*chunk_bounds(len(piece), num_chunks, coord))])
    return out


def _torch_split(placement: Any, dim: int, indices: list[int], num_chunks: int, coord: int) -> list[int]:
    """Chunk ``coord`` of ``indices`` as the placement's own ``_split_tensor`` computes it
    (torch's arithmetic), falling back to `_port_split` if that private method is unusable."""
    split = getattr(placement, "_split_tensor", None)
    if split is not None:
        index = torch.tensor(indices, dtype=torch.int64).view([1] * dim + [len(indices)])
        try:
            chunks, _ = split(index, num_chunks, with_padding=False, contiguous=False)
            return [int(i) for i in chunks[coord].reshape(-1).tolist()]
        except (TypeError, AttributeError, IndexError):
            pass
    return _port_split(placement, indices, num_chunks, coord)


def _spec_shard_order(tensor: Any) -> dict[int, list[int]] | None:
    """The DTensor's own shard order where its spec records one (recent torch: specs built
    with ``use_strided_shard_as_shard_order=False``, e.g. by view ops, carry ``shard_order``
    and mean `_StridedShard` as its own split); None where the placements alone decide."""
    spec = getattr(tensor, "_spec", None)
    if getattr(spec, "use_strided_shard_as_shard_order", None) is not False:
        return None
    order = getattr(spec, "shard_order", None)
    if order is None:
        return None
    return {int(e.tensor_dim): [int(m) for m in e.mesh_dims] for e in order}


def local_runs(
    name: str,
    global_shape: Sequence[int],
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    mesh: Any = None,
    shard_order: Mapping[int, Sequence[int]] | None = None,
) -> list[list[Run]]:
    """Per tensor dim, the runs ``(local_start, global_start, length)`` of global indices that the
    rank at mesh ``coordinate`` holds, in local order.

    ``shard_order`` (tensor dim -> mesh dims in application order), when given, is the DTensor
    spec's own order, and each placement then applies its own split (`_StridedShard`'s
    ``_split_tensor``). Without it, placements that decode into a shard order are applied in
    that order as plain chunks (``mesh``, the DeviceMesh, lets torch decode; else the port
    does), and others left to right with their own splits. Raises `MetadataError` for Partial
    (a partial tensor has no defined local piece) and for placements this module does not know.
    """
    ndim = len(global_shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    shard_dims: list[int | None] = []
    for mesh_dim, p in enumerate(placements):
        if _is_strided(p) or isinstance(p, Shard):
            shard_dims.append(_norm_dim(p, ndim, name))
        elif isinstance(p, Replicate):
            shard_dims.append(None)
        elif p.is_partial():
            raise MetadataError(
                f"parameter {name!r}: Partial placement {p!r} on mesh dim {mesh_dim} is a pending reduction, "
                "so no rank holds a defined piece; redistribute it to Replicate or Shard first"
            )
        else:
            raise MetadataError(f"parameter {name!r}: unsupported placement {p!r} on mesh dim {mesh_dim}")
    left_to_right: dict[int, list[int]] = {}
    for mesh_dim, dim in enumerate(shard_dims):
        if dim is not None:
            left_to_right.setdefault(dim, []).append(mesh_dim)
    as_chunks = False
    if shard_order is not None:
        orders = {int(d): list(m) for d, m in shard_order.items()}
        if {d: sorted(m) for d, m in orders.items()} != left_to_right:
            raise MetadataError(
                f"parameter {name!r}: shard order {orders} does not match placements {tuple(placements)}"
            )
    else:
        decoded = _shard_order(placements, shard_dims, mesh, mesh_shape)
        as_chunks = decoded is not None
        orders = decoded if decoded is not None else left_to_right
    runs: list[list[Run]] = [[(0, 0, int(s))] for s in global_shape]
    for dim, mesh_dims in orders.items():
        seq: Sequence[int] = range(int(global_shape[dim]))
        for mesh_dim in mesh_dims:
            p, n, c = placements[mesh_dim], mesh_shape[mesh_dim], int(coordinate[mesh_dim])
            if as_chunks or not _is_strided(p):
                seq = seq[slice(*chunk_bounds(len(seq), n, c))]  # torch.chunk; a range stays a range
            else:
                seq = _torch_split(p, dim, list(seq), n, c)
        if isinstance(seq, range):
            runs[dim] = [(0, seq.start if len(seq) else 0, len(seq))]
        else:
            runs[dim] = _runs_from_indices(seq) if seq else [(0, 0, 0)]
    return runs


def _pieces(rank: int, runs: list[list[Run]]) -> list[ShardMeta]:
    if not runs:  # 0-d tensor
        return [ShardMeta(rank, (), ())]
    if any(n == 0 for dim_runs in runs for _, _, n in dim_runs):
        return []
    out = []
    for combo in itertools.product(*runs):
        local = tuple(r[0] for r in combo)
        out.append(
            ShardMeta(
                rank,
                tuple(r[1] for r in combo),
                tuple(r[2] for r in combo),
                None if not any(local) else local,
            )
        )
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _items(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, Any]]:
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    seen: set[str] = set()
    for name, _ in items:
        if name in seen:
            raise MetadataError(f"parameter {name!r} appears twice in named_tensors")
        seen.add(name)
    return items


def metas_from_dtensors(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    rank: int,
) -> list[ParameterMeta]:
    """The exact pieces that THIS rank holds of each named tensor, as `ParameterMeta` objects
    with ``shards`` from ``rank`` only (merge the ranks' lists with ``merge_metas``).

    ``named_tensors`` maps canonical names to tensors (a dict, or pairs such as
    ``model.named_parameters()``). A DTensor (or a Parameter wrapping one) yields the boxes of
    its global tensor that its local tensor holds, for any mix of ``Shard`` (any dim, uneven
    chunks), ``Replicate`` and ``_StridedShard`` over meshes of any rank, including sub-meshes
    of the world; a rank outside the DTensor's mesh gets a meta with no shards. A plain tensor
    is a full replica on this rank. ``rank`` is the number written into the pieces (the
    side-local rank), not looked up. ``local_offset`` is set where a box does not start at the
    local tensor's origin (disjoint `_StridedShard` pieces).

    Raises `MetadataError` for ``Partial`` placements, unknown placements, duplicate names, and
    when the computed local shape differs from the rank's real local tensor.
    """
    rank = int(rank)
    cache: dict[tuple, list[list[Run]]] = {}
    out: list[ParameterMeta] = []
    for name, tensor in _items(named_tensors):
        global_shape = tuple(int(s) for s in tensor.shape)
        dtype = _dtype_name(tensor.dtype)
        if not isinstance(tensor, DTensor):
            out.append(
                ParameterMeta(
                    name, global_shape, dtype, (ShardMeta(rank, (0,) * len(global_shape), global_shape),)
                )
            )
            continue
        mesh = tensor.device_mesh
        placements = tuple(tensor.placements)
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            out.append(ParameterMeta(name, global_shape, dtype, ()))
            continue
        order = _spec_shard_order(tensor)
        frozen = None if order is None else tuple(sorted((d, tuple(m)) for d, m in order.items()))
        # repr names the type and split factor: older torch makes _StridedShard == Shard.
        key = (global_shape, tuple(mesh.shape), tuple(coordinate), tuple(map(repr, placements)), frozen)
        runs = cache.get(key)
        if runs is None:
            runs = local_runs(name, global_shape, placements, tuple(mesh.shape), coordinate, mesh, order)
            cache[key] = runs
        local_shape = tuple(sum(n for _, _, n in dim_runs) for dim_runs in runs)
        actual = tuple(int(s) for s in tensor.to_local().shape)
        if local_shape != actual:
            raise MetadataError(
                f"parameter {name!r} on rank {rank}: placements {placements} on mesh "
                f"{tuple(mesh.shape)} at coordinate {tuple(coordinate)} give a local shape "
                f"{local_shape}, but the local tensor has shape {actual}"
            )
        out.append(ParameterMeta(name, global_shape, dtype, tuple(_pieces(rank, runs))))
    return out
