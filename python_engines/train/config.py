"""Configuration of `FSDPTrainEngine` (field names follow AReaL's TrainEngineConfig where it has one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from python_engines.api import Scheduling
from python_engines.train.lr import LR_SCHEDULER_TYPES

COMPUTE_DTYPES = ("bfloat16", "float32")


@dataclass
class MicroBatchSpec:
    """How `train_batch` / `forward` split a batch: at least ``n_mbs`` micro-batches, each within
    ``max_tokens_per_mb`` padded token slots (None: no budget)."""

    n_mbs: int = 1
    max_tokens_per_mb: int | None = None

    def __post_init__(self) -> None:
        if self.n_mbs < 1:
            raise ValueError(f"MicroBatchSpec.n_mbs must be >= 1, got {self.n_mbs}")
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb <= 0:
            raise ValueError(
                f"MicroBatchSpec.max_tokens_per_mb must be positive, got {self.max_tokens_per_mb}"
            )


@dataclass
class OptimizerConfig:
    """AdamW and its LR schedule (AReaL's OptimizerConfig names and defaults)."""

    type: str = "adam"
    lr: float = 2e-5
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-5
    min_lr_ratio: float = 0.0
    lr_scheduler_type: str = "constant"
    warmup_steps_proportion: float = 0.001
    gradient_clipping: float = 1.0

    def __post_init__(self) -> None:
        if self.type != "adam":
            raise ValueError(f"OptimizerConfig.type must be 'adam' (AdamW), got {self.type!r}")
        if self.lr_scheduler_type not in LR_SCHEDULER_TYPES:
            raise ValueError(
                f"OptimizerConfig.lr_scheduler_type must be one of {LR_SCHEDULER_TYPES}, "
                f"got {self.lr_scheduler_type!r}"
            )
        if self.lr < 0:
            raise ValueError(f"OptimizerConfig.lr must be >= 0, got {self.lr}")
        if self.gradient_clipping < 0:
            raise ValueError(
                f"OptimizerConfig.gradient_clipping must be >= 0 (0: off), got {self.gradient_clipping}"
            )


@dataclass
class FSDPEngineConfig:
    """What `FSDPTrainEngine` builds.

    Model source: ``path`` (a local Hugging Face directory, weights loaded; there is no hub
    access) or, when ``path`` is None, ``model_config`` (a ``transformers.PretrainedConfig``,
    random init); ``init_from_scratch=True`` random-inits from ``path``'s config instead.
    ``dtype`` is the compute dtype: ``"bfloat16"`` keeps float32 master weights and reduces
    gradients in float32, ``"float32"`` computes in float32. Parallelism: ``tp_size`` ranks per
    tensor-parallel group, ``dp_size`` data-parallel groups (None: world size // tp_size).
    ``optimizer=None`` builds a forward-only engine (e.g. a reference model). ``device`` None picks CUDA
    (``cuda:$LOCAL_RANK``, nccl) when available and the existing process group, if any, has nccl;
    else CPU (gloo). ``seed`` seeds random init identically on every rank.
    """

    path: str | None = None
    model_config: Any = None
    init_from_scratch: bool = False
    dtype: str = "bfloat16"
    attn_impl: str = "sdpa"
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerConfig | None = field(default_factory=OptimizerConfig)
    gradient_checkpointing: bool = False
    tp_size: int = 1
    dp_size: int | None = None
    reshard_after_forward: bool = True
    device: str | None = None
    seed: int = 1
    save_max_shard_bytes: int = 5 << 30
    scheduling: Scheduling | None = None

    def __post_init__(self) -> None:
        if self.path is None and self.model_config is None:
            raise ValueError("FSDPEngineConfig needs path (a local HF directory) or model_config")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"FSDPEngineConfig.dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        if self.tp_size < 1:
            raise ValueError(f"FSDPEngineConfig.tp_size must be >= 1, got {self.tp_size}")
        if self.dp_size is not None and self.dp_size < 1:
            raise ValueError(f"FSDPEngineConfig.dp_size must be >= 1, got {self.dp_size}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"FSDPEngineConfig.device must be None, 'cpu' or 'cuda', got {self.device!r}")
        if self.save_max_shard_bytes <= 0:
            raise ValueError(
                f"FSDPEngineConfig.save_max_shard_bytes must be positive, got {self.save_max_shard_bytes}"
            )
