"""`FSDPTrainEngine`: a Hugging Face causal LM under FSDP2 (+ tensor parallel), AdamW, LR schedule.

Contract (who calls what, in which order; every method is collective over the engine's ranks):

1. ``engine = FSDPTrainEngine(FSDPEngineConfig(...))``; ``engine.initialize(addr, ft_spec)``
   joins the default process group (or creates it from ``addr`` / ``env://``), builds the
   ``(dp, tp)`` mesh, the model (float32 master weights), TP, FSDP2, AdamW and the LR schedule.
2. Each step: ``stats = engine.train_batch(batch, loss_fn, loss_weight_fn)`` then
   ``engine.step_lr_scheduler()``. Every data-parallel rank passes its own batch; the ranks of
   one TP group must pass identical batches.
3. ``engine.upload_weights(meta)`` after a step hands the new weights to inference
   (``"disk"``: HF checkpoint + version marker, see `python_engines.api`; ``"awex"``: the send
   half of an in-memory update through `weight_sync_adapter`, see "Awex uploads" below).
4. ``engine.destroy()``.

The loss contract (AReaL style, padded rather than packed): ``loss_fn(logits, mb) -> scalar``
where ``mb`` is a TensorDict of ``n`` rows of the batch trimmed to ``L`` columns (every entry
whose second dim was ``S`` is trimmed the same way) and ``logits`` is ``[n, L, vocab]`` float32.
``loss_fn`` returns the loss *averaged over its own micro-batch* in whatever unit
``loss_weight_fn(mb)`` counts (typically: mean over loss tokens, weighted by the number of loss
tokens). The step minimises ``sum_mb loss_fn(mb) * w(mb) / sum of w over all micro-batches of all
data-parallel ranks``, which equals the loss of the whole global batch computed at once.

A failed step (non-finite gradient norm, e.g. from a NaN loss) zeroes the gradients, leaves
weights and optimizer state untouched and reports ``update_successful = 0.0``.

For weight sync, `named_local_parameters` exposes the live parameters under their canonical HF
names: DTensors (FSDP2 dim-0 shards, ``_StridedShard`` x ``Shard`` under TP) whose
``to_local()`` is this rank's memory; a writer into it updates the model in place.

Awex uploads (docs/DESIGN.md, "Who drives an update") live in `python_engines.train.weight_sync`:
`weight_sync_adapter` is this engine's ``awex_fast.TrainingAdapter``; ``upload_weights(meta)``
with type ``"awex"`` sends over the group a controller formed on it, or joins one itself with no
controller (the steps of ``awex_fast.sync.join``), or, after `connect_engine`, sends into vLLM
servers through awex_fast's vLLM backend. A failed join raises `WeightSyncNotWiredError` on
every rank, naming the step, the pair, the KV store and the failing ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.fsdp import FSDPModule

from python_engines.api import (
    WEIGHT_VERSION_MARKER,
    FinetuneSpec,
    LossFn,
    LossWeightFn,
    ParamSpec,
    PostHook,
    SaveLoadMeta,
    Scheduling,
    TrainEngine,
    WeightUpdateMeta,
    write_weight_version,
)
from python_engines.train.checkpoint import (
    copy_aux_files,
    load_hf_into,
    load_optimizer_state,
    save_hf,
    save_optimizer_state,
)
from python_engines.train.config import FSDPEngineConfig
from python_engines.train.lr import build_lr_scheduler, warmup_steps_from_proportion
from python_engines.train.microbatch import (
    MicroBatch,
    ffd_groups,
    pad_and_stack,
    sequence_lengths,
    split_batch,
    with_fillers,
)
from python_engines.train.parallel import (
    apply_fsdp,
    apply_tp,
    build_mesh,
    clip_grad_norm_,
    mixed_precision_policy,
)
from python_engines.train.weight_sync import TRAINING_RANK_META_KEY, TrainWeightSync, WeightSyncNotWiredError

if TYPE_CHECKING:
    from awex_fast.sync import TrainingAdapter

__all__ = ["TRAINING_RANK_META_KEY", "FSDPTrainEngine", "WeightSyncNotWiredError"]

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FSDPTrainEngine(TrainEngine):
    """FSDP2 (+TP) training engine over a transformers causal LM; see the module docstring."""

    def __init__(self, config: FSDPEngineConfig) -> None:
        """Store the configuration; nothing is built until `initialize`."""
        self.config = config
        self._version = 0
        self._owns_process_group = False
        self._model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.ft_spec: FinetuneSpec | None = None
        self._tied_aliases: dict[str, str] = {}
        self._architectures: list[str] = []
        self._weight_sync = TrainWeightSync(self)  # awex uploads (python_engines.train.weight_sync)

    # ---------------------------------------------------------------------------- lifecycle

    def _wants_cuda(self) -> bool:
        """``config.device``, else CUDA when available and the process group (if any) has nccl."""
        if self.config.device is not None:
            return self.config.device == "cuda"
        if not torch.cuda.is_available():
            return False
        return not dist.is_initialized() or "nccl" in str(dist.get_backend()).lower()

    def _pick_device(self) -> torch.device:
        if self._wants_cuda():
            if not torch.cuda.is_available():
                raise RuntimeError("FSDPEngineConfig.device='cuda' but CUDA is not available")
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _build_model(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = self.config
        kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": cfg.attn_impl}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            if cfg.path is not None and not cfg.init_from_scratch:
                model = AutoModelForCausalLM.from_pretrained(cfg.path, **kwargs)
            else:
                model_config = cfg.model_config
                if cfg.path is not None:
                    model_config = AutoConfig.from_pretrained(cfg.path)
                model = AutoModelForCausalLM.from_config(model_config, **kwargs)
        model.config.use_cache = False
        return model

    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        """Build the sharded model, AdamW and the LR schedule sized by ``ft_spec``; collective.

        Joins the existing default process group, or creates one: from ``addr`` (``host:port``,
        with ``RANK`` / ``WORLD_SIZE`` in the environment) or from ``env://``. The backend is
        nccl on CUDA and gloo on CPU.
        """
        if self._model is not None:
            raise RuntimeError("FSDPTrainEngine.initialize called twice")
        cfg = self.config
        if not dist.is_initialized():
            init_method = f"tcp://{addr}" if addr else "env://"
            backend = "nccl" if self._wants_cuda() else "gloo"
            dist.init_process_group(backend=backend, init_method=init_method)
            self._owns_process_group = True
        self.device = self._pick_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        world = dist.get_world_size()
        if world % cfg.tp_size != 0:
            raise ValueError(f"world size {world} is not divisible by tp_size {cfg.tp_size}")
        dp_size = cfg.dp_size if cfg.dp_size is not None else world // cfg.tp_size
        self.mesh = build_mesh(self.device.type, dp_size, cfg.tp_size)

        model = self._build_model()
        self._architectures = [type(model).__name__]
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        if cfg.tp_size > 1:
            apply_tp(model, self.mesh["tp"])
        apply_fsdp(model, self.mesh["dp"], mixed_precision_policy(cfg.dtype), cfg.reshard_after_forward)
        self._model = model
        self._tied_aliases = self._find_tied_aliases(model)

        self.ft_spec = ft_spec
        if cfg.optimizer is not None:
            opt = cfg.optimizer
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=opt.lr,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
            if opt.lr_scheduler_type != "constant" and ft_spec is None:
                raise ValueError(f"a {opt.lr_scheduler_type!r} LR schedule needs ft_spec (got None)")
            total = ft_spec.total_train_steps if ft_spec is not None else 0
            self.lr_scheduler = build_lr_scheduler(
                self.optimizer,
                opt.lr_scheduler_type,
                total,
                warmup_steps_from_proportion(total, opt.warmup_steps_proportion),
                opt.min_lr_ratio,
            )

    @staticmethod
    def _find_tied_aliases(model: nn.Module) -> dict[str, str]:
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                aliases[name] = first[id(p)]
            else:
                first[id(p)] = name
        return aliases

    def destroy(self) -> None:
        """Leave the weight-sync group (if any); drop model and optimizer; destroy the process
        group if `initialize` created it."""
        self._weight_sync.close()
        self._model = None
        self.optimizer = None
        self.lr_scheduler = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    @property
    def model(self) -> nn.Module:
        """The FSDP2-wrapped transformers model (raises before `initialize`)."""
        if self._model is None:
            raise RuntimeError("FSDPTrainEngine is not initialized; call initialize() first")
        return self._model

    @property
    def parallelism_group(self) -> dist.ProcessGroup:
        """The default (world) process group: every rank of this engine."""
        self.model  # noqa: B018 (raises before initialize)
        return dist.group.WORLD

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """Ranks holding different data (the mesh's ``dp`` dimension)."""
        return self.mesh["dp"].get_group()

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index along ``dp``: which slice of the global batch it should feed."""
        return self.mesh["dp"].get_local_rank()

    @property
    def data_parallel_world_size(self) -> int:
        """Number of data-parallel groups."""
        return self.mesh["dp"].size()

    @property
    def tensor_parallel_group(self) -> dist.ProcessGroup:
        """Ranks sharing one batch and splitting the layers (the mesh's ``tp`` dimension)."""
        return self.mesh["tp"].get_group()

    def get_scheduling_config(self) -> Scheduling:
        """``config.scheduling`` if set, else 4 CPUs, 1 GPU (0 on CPU) and 32 GiB per process."""
        if self.config.scheduling is not None:
            return self.config.scheduling
        return Scheduling(cpu=4, gpu=1 if self._wants_cuda() else 0, mem=32 * 1024)

    def train(self, mode: bool = True) -> FSDPTrainEngine:
        """Set the model's training mode; returns self."""
        self.model.train(mode)
        return self

    def set_version(self, version: int) -> None:
        """Set the weight version."""
        self._version = int(version)

    def get_version(self) -> int:
        """The weight version."""
        return self._version

    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one optimizer step."""
        if self.lr_scheduler is None:
            raise RuntimeError("this engine has no optimizer (FSDPEngineConfig.optimizer=None)")
        self.lr_scheduler.step()

    # ---------------------------------------------------------------------------- parameters

    def named_local_parameters(self) -> dict[str, torch.Tensor]:
        """Canonical HF name -> this rank's live parameter (a DTensor, or a plain tensor).

        The values are detached views sharing the parameters' storage: ``t.to_local()`` of a
        DTensor is this rank's shard, ``t.device_mesh`` / ``t.placements`` describe the layout,
        and an in-place write into the local tensor lands in the model. Tied parameters appear
        once, under their first name (``model.embed_tokens.weight``; see `tied_aliases`).
        Valid between steps (after `train_batch` returns, FSDP2 holds only the shards).
        """
        return {name: p.detach() for name, p in self.model.named_parameters()}

    @property
    def tied_aliases(self) -> dict[str, str]:
        """Tied names left out of `named_local_parameters` -> the name they share storage with."""
        return dict(self._tied_aliases)

    def get_param_specs(self) -> list[ParamSpec]:
        """Canonical names, global shapes (DTensor.shape is global) and master dtypes; no gathering."""
        return [
            ParamSpec(name, tuple(p.shape), _dtype_name(p.dtype)) for name, p in self.model.named_parameters()
        ]

    # ---------------------------------------------------------------------------- batches

    def _all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.data_parallel_group)
        return t.tolist()

    def _micro_batches(self, input_: TensorDict) -> list[MicroBatch]:
        """Split ``input_`` and top up with fillers to the largest count over data-parallel ranks."""
        spec = self.config.mb_spec
        batch = input_.to(self.device)
        for key in ("input_ids", "attention_mask"):
            if key not in batch.keys():  # noqa: SIM118 (TensorDict has no __contains__)
                raise KeyError(f"batch has no {key!r} entry (keys: {sorted(batch.keys())})")
        local = len(ffd_groups(sequence_lengths(batch["attention_mask"]), spec.max_tokens_per_mb, spec.n_mbs))
        count = int(self._all_reduce([float(local)], dist.ReduceOp.MAX)[0])
        return with_fillers(split_batch(batch, spec.max_tokens_per_mb, count), batch, count)

    def _logits(self, mb: TensorDict) -> torch.Tensor:
        mask = mb["attention_mask"]
        if "position_ids" in mb.keys():  # noqa: SIM118 (TensorDict has no __contains__)
            position_ids = mb["position_ids"]
        else:
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=mb["input_ids"], attention_mask=mask, position_ids=position_ids, use_cache=False
        )
        return out.logits.float()

    def _weights(self, mbs: list[MicroBatch], loss_weight_fn: LossWeightFn) -> tuple[list[float], float]:
        weights = [0.0 if mb.filler else float(loss_weight_fn(mb.data)) for mb in mbs]
        for mb, w in zip(mbs, weights, strict=True):
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"loss_weight_fn returned {w} for micro-batch rows {list(mb.indices)}")
        total = self._all_reduce([sum(weights)])[0]
        if total <= 0:
            raise ValueError(f"loss_weight_fn sums to {total} over all data-parallel ranks; it must be > 0")
        return weights, total

    @staticmethod
    def _scalar(loss: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape} for rows {list(mb.indices)}")
        return loss.reshape(())

    def train_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step; returns ``update_successful``, ``grad_norm``, ``lr`` and ``loss``.

        Gradients are reduced across data-parallel ranks once, after the last micro-batch;
        ``lr`` is the rate this step used; ``loss`` is the weighted global loss.
        """
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (FSDPEngineConfig.optimizer=None)")
        model = self.model
        mbs = self._micro_batches(input_)
        weights, total = self._weights(mbs, loss_weight_fn)
        dp_size = self.data_parallel_world_size
        self.optimizer.zero_grad(set_to_none=True)
        weighted_loss = 0.0
        for i, mb in enumerate(mbs):
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(i == len(mbs) - 1)
            logits = self._logits(mb.data)
            if mb.filler:
                loss = logits.sum() * 0.0
            else:
                raw = self._scalar(loss_fn(logits, mb.data), mb)
                scale = weights[i] / total
                weighted_loss += float(raw.detach()) * scale
                # FSDP2 averages gradients over dp; the weights already divide by the global total.
                loss = raw * (scale * dp_size)
            loss.backward()
        max_norm = self.config.optimizer.gradient_clipping if self.config.optimizer is not None else 0.0
        grad_norm = clip_grad_norm_(model.parameters(), max_norm)
        ok = math.isfinite(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = self._all_reduce([weighted_loss])[0]
        return {"update_successful": 1.0 if ok else 0.0, "grad_norm": grad_norm, "lr": lr, "loss": loss_value}

    @torch.no_grad()
    def eval_batch(self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> torch.Tensor:
        """The weighted global loss (same weighting as `train_batch`) as a float64 scalar tensor."""
        mbs = self._micro_batches(input_)
        weights, total = self._weights(mbs, loss_weight_fn)
        weighted_loss = 0.0
        for i, mb in enumerate(mbs):
            logits = self._logits(mb.data)
            if not mb.filler:
                weighted_loss += float(self._scalar(loss_fn(logits, mb.data), mb)) * weights[i] / total
        return torch.tensor(self._all_reduce([weighted_loss])[0], dtype=torch.float64)

    @torch.no_grad()
    def forward(
        self,
        input_: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: PostHook | None = None,
        aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat,
    ) -> torch.Tensor:
        """Forward without gradients, per sequence, in the batch's original row order.

        Per micro-batch, ``post_hook(logits, mb)`` (default: the float32 logits) must return a
        tensor with leading dims ``[n, L]``; row ``i`` keeps its first ``output_seqlens[i]``
        real-token positions (default: all real tokens), and these are packed along dim 0.
        ``aggregate_fn`` joins the micro-batches' packed outputs (default ``torch.cat``); the result
        is split per sequence and right-padded with zeros into ``[B, max(output_seqlens), ...]``.
        """
        lengths = sequence_lengths(input_["attention_mask"])
        out_lens = [int(n) for n in output_seqlens] if output_seqlens is not None else lengths
        if len(out_lens) != len(lengths):
            raise ValueError(f"output_seqlens has {len(out_lens)} entries for a batch of {len(lengths)} rows")
        packed: list[torch.Tensor] = []
        order: list[int] = []
        for mb in self._micro_batches(input_):
            logits = self._logits(mb.data)
            if mb.filler:
                continue
            result = post_hook(logits, mb.data) if post_hook is not None else logits
            mask = mb.data["attention_mask"].ne(0)
            if result.ndim < 2 or tuple(result.shape[:2]) != tuple(mask.shape):
                raise ValueError(
                    f"post_hook output {tuple(result.shape)} must start with the micro-batch's [n, L] = "
                    f"{tuple(mask.shape)}"
                )
            pieces = []
            for r, row in enumerate(mb.indices):
                real = result[r][mask[r]]
                if out_lens[row] > real.shape[0]:
                    raise ValueError(
                        f"output_seqlens[{row}] = {out_lens[row]} exceeds its {real.shape[0]} tokens"
                    )
                pieces.append(real[: out_lens[row]])
                order.append(row)
            packed.append(torch.cat(pieces))
        joined = aggregate_fn(packed)
        sizes = [out_lens[row] for row in order]
        if joined.shape[0] != sum(sizes):
            raise ValueError(
                f"aggregate_fn returned {joined.shape[0]} rows along dim 0, expected {sum(sizes)}"
            )
        by_row: dict[int, torch.Tensor] = dict(zip(order, torch.split(joined, sizes), strict=True))
        return pad_and_stack([by_row[row] for row in range(len(lengths))])

    # ---------------------------------------------------------------------------- save / load

    def _save_hf(self, path: str) -> None:
        model = self.model
        config = model.config
        config.architectures = list(self._architectures)
        save_hf(
            self.named_local_parameters(),
            config,
            path,
            self.config.save_max_shard_bytes,
            generation_config=getattr(model, "generation_config", None),
        )

    def save(self, meta: SaveLoadMeta) -> None:
        """Write an HF checkpoint to ``meta.path`` (and DCP optimizer state when ``with_optim``)."""
        if meta.weight_format != "hf":
            raise ValueError(f"SaveLoadMeta.weight_format must be 'hf', got {meta.weight_format!r}")
        self._save_hf(meta.path)
        if dist.get_rank() == 0:
            if meta.tokenizer is not None:
                meta.tokenizer.save_pretrained(meta.path)
            elif meta.base_model_path is not None:
                copy_aux_files(meta.base_model_path, meta.path)
        if meta.with_optim:
            if self.optimizer is None:
                raise RuntimeError("with_optim=True but this engine has no optimizer")
            save_optimizer_state(self.model, self.optimizer, self.lr_scheduler, meta.path)
        dist.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        """Load weights (and, with ``with_optim``, optimizer and scheduler state) from ``meta.path``."""
        if meta.weight_format != "hf":
            raise ValueError(f"SaveLoadMeta.weight_format must be 'hf', got {meta.weight_format!r}")
        params = dict(self.model.named_parameters())
        load_hf_into(self.model, params, meta.path, self._tied_aliases, self.device)
        if meta.with_optim:
            if self.optimizer is None:
                raise RuntimeError("with_optim=True but this engine has no optimizer")
            load_optimizer_state(self.model, self.optimizer, self.lr_scheduler, meta.path)
        dist.barrier()

    # ---------------------------------------------------------------------------- weight upload

    def weight_sync_adapter(self) -> TrainingAdapter:
        """This engine's ``awex_fast.TrainingAdapter`` (an ``AwexTrainingAdapter``), built on
        first use and kept: over `named_local_parameters` (so it always sees the live shards),
        side-local rank = global rank, parallelism from the mesh, the optimizer's memory tag,
        gloo on CPU and nccl on CUDA, admin key from ``$AWEX_FAST_ADMIN_KEY`` until an awex
        `upload_weights` brings one in its `WeightUpdateMeta`. Serve it (``/awex/*`` routes) to a
        `WeightSyncPair`, or let `upload_weights` join a group itself
        (`python_engines.train.weight_sync`)."""
        return self._weight_sync.adapter()

    @property
    def last_weight_update(self) -> dict[str, Any] | None:
        """The stats of the last successful awex upload on this rank (bytes, seconds), or None."""
        return self._weight_sync.last_update

    def connect_engine(self, engine: Any, *, timeout_s: float = 300.0) -> None:
        """Send awex uploads to vLLM servers through awex_fast's vLLM backend: ``engine`` is an
        inference engine with ``addresses`` (`python_engines.inference.RemotevLLMEngine`), one
        server URL or a list of them. Call on every rank; the first awex upload joins (every
        rank sends its own shards; rank 0 drives vLLM's weight-sync routes). ``timeout_s`` bounds
        every wait of a join or a round (a worker waiting for bytes that never come). Calling it
        again with other servers (say, without one that died) leaves the old group; the next
        upload joins the new one."""
        self._weight_sync.connect_engine(engine, timeout_s=timeout_s)

    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """Send the current weights to inference; collective.

        ``"disk"``: remove the old version marker, write the HF checkpoint to ``meta.path``, then
        write the marker for ``meta.version`` (default: `get_version`) last and atomically.
        ``"awex"`` (or ``"nccl"``): the send half of an in-memory update of ``meta.version``
        (default: `get_version`) through `weight_sync_adapter`; the first call joins the group
        unless a controller formed it (`python_engines.train.weight_sync`). Raises
        `WeightSyncNotWiredError` when the join fails, ``TransferError`` when the update does.
        """
        if meta.type == "disk":
            if not meta.path:
                raise ValueError("WeightUpdateMeta.path is required for a disk update")
            version = meta.version if meta.version is not None else self._version
            if dist.get_rank() == 0:
                os.makedirs(meta.path, exist_ok=True)
                marker = os.path.join(meta.path, WEIGHT_VERSION_MARKER)
                if os.path.exists(marker):
                    os.unlink(marker)
            dist.barrier()
            self._save_hf(meta.path)
            if dist.get_rank() == 0:
                write_weight_version(meta.path, version)
            dist.barrier()
            return
        if meta.type in ("awex", "nccl"):
            self._weight_sync.upload(meta)
            return
        raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'awex' or 'nccl', got {meta.type!r}")

