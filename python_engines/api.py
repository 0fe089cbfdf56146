"""The seed train / inference engine API: abstract engines and the structs they exchange.

Why a copy of AReaL's arealite API: RL code written against AReaL (``TrainEngine.train_batch``,
``InferenceEngine.update_weights``, ``WeightUpdateMeta.from_disk`` ...) should run on these engines
unchanged, so every struct keeps arealite's field names and defaults. What is ours:

- ``WeightUpdateMeta.type`` is ``"disk"`` or ``"awex"``; ``"nccl"`` (AReaL's name for the in-memory
  path) is accepted and normalised to ``"awex"``, and the awex fields (pair name, KV store URL,
  admin key, version) sit next to AReaL's ``nccl_*`` fields, which carry the master address/port.
- The disk weight-update hand-off is a file protocol defined here, so that both sides agree on it:
  the trainer writes a Hugging Face checkpoint into ``meta.path`` and then, last and atomically,
  the marker file `WEIGHT_VERSION_MARKER` holding ``{"version": v}``; the inference side waits for
  a marker whose version is at least the one it expects (`wait_for_weight_version`) and only then
  reads the weights. The trainer removes the marker before it starts overwriting the files, so a
  marker on disk always describes complete files.

Who calls what, in which order (the order AReaL uses): the RL loop calls
``fut = inference.update_weights(meta)`` (receive half, returns at once), then
``train.upload_weights(meta)`` (send half, blocks until sent), then ``fut.result()``; afterwards
``inference.set_version(v)`` and ``train.set_version(v)``.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from awex_fast.net import ADMIN_KEY_ENV
from python_engines.weight_marker import (  # re-exported: AReaL-style code imports them from the API
    WEIGHT_VERSION_MARKER,
    read_weight_version,
    wait_for_weight_version,
    write_weight_version,
)

if TYPE_CHECKING:
    import torch.distributed as dist
    from tensordict import TensorDict
    from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = [
    "WEIGHT_VERSION_MARKER",
    "FinetuneSpec",
    "GenerationHyperparameters",
    "InferenceEngine",
    "LLMRequest",
    "LLMResponse",
    "ParamSpec",
    "RolloutWorkflow",
    "SaveLoadMeta",
    "Scheduling",
    "TrainEngine",
    "WeightUpdateMeta",
    "read_weight_version",
    "wait_for_weight_version",
    "write_weight_version",
]




# --------------------------------------------------------------------------------------------
# Structs
# --------------------------------------------------------------------------------------------


@dataclass
class Scheduling:
    """Resources one engine process asks its launcher for.

    ``mem`` is in MiB (AReaL's servers ask for ``32 * 1024``). ``time_limit``, ``begin`` and
    ``deadline`` use Slurm ``sbatch`` formats (``--time``, ``--begin``, ``--deadline``).
    """

    cpu: int
    gpu: int
    mem: int
    nodelist: str | None = None
    exclude: str | None = None
    partition: str | None = None
    container_image: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    time_limit: str | None = None
    begin: str | None = None
    deadline: str | None = None


@dataclass
class FinetuneSpec:
    """Size of a training run, from which LR schedules are sized.

    Steps assume the dataloader drops the last incomplete batch, as AReaL's does.
    """

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    def __post_init__(self) -> None:
        if self.train_batch_size <= 0:
            raise ValueError(f"FinetuneSpec.train_batch_size must be positive, got {self.train_batch_size}")
        if self.total_train_epochs < 0 or self.dataset_size < 0:
            raise ValueError(
                "FinetuneSpec.total_train_epochs and dataset_size must be >= 0, got "
                f"{self.total_train_epochs} and {self.dataset_size}"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch: ``dataset_size // train_batch_size``."""
        return self.dataset_size // self.train_batch_size

    @property
    def total_train_steps(self) -> int:
        """Optimizer steps in the whole run: ``total_train_epochs * steps_per_epoch``."""
        return self.total_train_epochs * self.steps_per_epoch


@dataclass
class ParamSpec:
    """One parameter as the trainer holds it: canonical (HF) name, global shape, dtype string."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        if self.dtype.startswith("torch."):
            raise ValueError(f"ParamSpec({self.name!r}).dtype must be like 'bfloat16', got {self.dtype!r}")

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class SaveLoadMeta:
    """What `TrainEngine.save` / `TrainEngine.load` read or write.

    ``weight_format`` is ``"hf"`` (safetensors + config.json, loadable by ``from_pretrained``).
    ``with_optim`` adds optimizer and LR-scheduler state (torch.distributed.checkpoint, one
    directory written by every rank). ``tokenizer`` is saved next to the weights when given;
    otherwise tokenizer files found in ``base_model_path`` are copied. ``naive_distributed`` is kept
    for AReaL compatibility; engines that always write from one rank ignore it.
    """

    path: str
    weight_format: str = "hf"
    with_optim: bool = False
    tokenizer: Any = None
    base_model_path: str | None = None
    naive_distributed: bool = False


@dataclass
class WeightUpdateMeta:
    """How the trainer's new weights reach the inference engines.

    ``type="disk"``: through a checkpoint in ``path`` plus the `WEIGHT_VERSION_MARKER` file.
    ``type="awex"`` (``"nccl"`` is accepted and normalised to ``"awex"``): in memory through an
    awex_fast weight-sync pair: ``pair_name`` names it in the KV store at ``kv_store_url``,
    ``nccl_master_address`` / ``nccl_master_port`` are where the transfer group rendezvous
    (port 29500 is AReaL's default and only a default: real runs bind a free port and publish it),
    ``admin_api_key`` authorises mutating KV routes (default: ``$AWEX_FAST_ADMIN_KEY``).
    ``version`` is the weight version this update produces (None: the engine's current version).
    """

    type: Literal["disk", "awex", "nccl"]
    path: str | None = None
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 29500
    nccl_param_specs: list[ParamSpec] = field(default_factory=list)
    nccl_group_name: str = "update_weight_group"
    pair_name: str = "default"
    kv_store_url: str | None = None
    admin_api_key: str | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        if self.type == "nccl":
            self.type = "awex"
        if self.type not in ("disk", "awex"):
            raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'awex' or 'nccl', got {self.type!r}")
        if self.type == "disk" and not self.path:
            raise ValueError("WeightUpdateMeta.path is required when type='disk'")
        if "/" in self.pair_name or not self.pair_name:
            raise ValueError(
                f"WeightUpdateMeta.pair_name must be non-empty without '/', got {self.pair_name!r}"
            )

    @property
    def master_address(self) -> str:
        """Rendezvous host of the weight-transfer group (AReaL's ``nccl_master_address``)."""
        return self.nccl_master_address

    @property
    def master_port(self) -> int:
        """Rendezvous port of the weight-transfer group (AReaL's ``nccl_master_port``)."""
        return self.nccl_master_port

    @classmethod
    def from_disk(cls, path: str, version: int | None = None) -> WeightUpdateMeta:
        """A disk update through the checkpoint directory ``path``."""
        return cls(type="disk", path=str(path), version=version)

    @classmethod
    def from_awex(
        cls,
        pair_name: str,
        kv_store_url: str,
        master_address: str = "127.0.0.1",
        master_port: int = 29500,
        admin_api_key: str | None = None,
        version: int | None = None,
        param_specs: list[ParamSpec] | None = None,
        group_name: str = "update_weight_group",
    ) -> WeightUpdateMeta:
        """An in-memory awex update through pair ``pair_name`` registered at ``kv_store_url``.

        ``admin_api_key`` defaults to the ``AWEX_FAST_ADMIN_KEY`` environment variable.
        """
        if admin_api_key is None:
            admin_api_key = os.environ.get(ADMIN_KEY_ENV)
        return cls(
            type="awex",
            nccl_master_address=master_address,
            nccl_master_port=int(master_port),
            nccl_param_specs=list(param_specs or []),
            nccl_group_name=group_name,
            pair_name=pair_name,
            kv_store_url=kv_store_url,
            admin_api_key=admin_api_key,
            version=version,
        )


@dataclass
class GenerationHyperparameters:
    """Sampling settings of one request (AReaL names and defaults)."""

    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = 100_000_000
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"GenerationHyperparameters.n_samples must be >= 1, got {self.n_samples}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                "GenerationHyperparameters needs 0 <= min_new_tokens <= max_new_tokens, got "
                f"{self.min_new_tokens} and {self.max_new_tokens}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"GenerationHyperparameters.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1:
            raise ValueError(f"GenerationHyperparameters.top_k must be >= 1, got {self.top_k}")
        if self.temperature < 0.0:
            raise ValueError(f"GenerationHyperparameters.temperature must be >= 0, got {self.temperature}")

    def new(self, **changes: Any) -> GenerationHyperparameters:
        """A copy with ``changes`` applied; lists are copied, so the two never share state."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"GenerationHyperparameters has no field(s) {unknown}")
        args = dataclasses.asdict(self)
        args.update(changes)
        return GenerationHyperparameters(**args)


@dataclass
class LLMRequest:
    """One generation request; ``rid`` is a fresh uuid4 string unless given."""

    rid: str = field(default_factory=lambda: str(uuid.uuid4()))
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = field(default_factory=dict)
    model_id: str | None = None


@dataclass
class LLMResponse:
    """One generation result: tokens, per-token logprobs and the weight version of each token.

    ``stop_reason`` is ``"stop"``, ``"length"`` or ``"interrupt"``; ``latency`` / ``ttft`` are
    seconds (inf until measured) and ``itl`` the inter-token latencies.
    """

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: Literal["length", "stop", "interrupt"] = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    itl: list[float] = field(default_factory=list)

    @property
    def input_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        """Number of generated tokens."""
        return len(self.output_tokens)


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------

#: ``loss_fn(logits, mb) -> scalar``: ``logits`` are ``[n, L, vocab]`` float32 for the ``n`` rows of
#: micro-batch ``mb`` (a TensorDict holding those rows, trimmed to ``L`` columns).
LossFn = Callable[[torch.Tensor, "TensorDict"], torch.Tensor]
#: ``loss_weight_fn(mb) -> weight`` of the micro-batch, e.g. its number of loss tokens.
LossWeightFn = Callable[["TensorDict"], float | torch.Tensor]
#: ``post_hook(logits, mb) -> Tensor`` with leading dims ``[n, L]``, applied per micro-batch.
PostHook = Callable[[torch.Tensor, "TensorDict"], torch.Tensor]


class TrainEngine(abc.ABC):
    """A sharded training engine: forward/backward/step on batches, save/load, weight upload.

    Batches are ``tensordict.TensorDict`` objects holding at least ``input_ids`` and
    ``attention_mask`` (``[B, S]``, padded) plus whatever the loss needs. Every data-parallel rank
    passes its own batch; ranks of one model-parallel group pass the same batch.
    """

    @abc.abstractmethod
    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        """Join (or create) the process group, build the model, optimizer and LR schedule.

        ``addr`` (``host:port``) is the rendezvous when no process group exists yet; None uses
        the ``env://`` variables. ``ft_spec`` sizes the LR schedule.
        """
        raise NotImplementedError

    @property
    @abc.abstractmethod
    def parallelism_group(self) -> dist.ProcessGroup:
        """The process group spanning every rank of this engine."""
        raise NotImplementedError

    @abc.abstractmethod
    def get_scheduling_config(self) -> Scheduling:
        """Resources each process of this engine needs."""
        raise NotImplementedError

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the model, optimizer and any process group the engine created."""
        raise NotImplementedError

    @abc.abstractmethod
    def train(self, mode: bool = True) -> TrainEngine:
        """Set training mode (dropout etc.) and return self."""
        raise NotImplementedError

    def eval(self) -> TrainEngine:
        """Set evaluation mode and return self (``train(False)``)."""
        return self.train(False)

    @abc.abstractmethod
    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """Run the trainer's half of a weight update described by ``meta``; collective."""
        raise NotImplementedError

    @abc.abstractmethod
    def get_param_specs(self) -> list[ParamSpec]:
        """Canonical names, global shapes and dtypes of all parameters, without gathering any."""
        raise NotImplementedError

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the weight version (RL step) the engine's weights correspond to."""
        raise NotImplementedError

    @abc.abstractmethod
    def get_version(self) -> int:
        """The current weight version."""
        raise NotImplementedError

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None:
        """Save weights (and, with ``meta.with_optim``, optimizer state); collective."""
        raise NotImplementedError

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None:
        """Load what `save` wrote; collective."""
        raise NotImplementedError

    @abc.abstractmethod
    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one step (call once per optimizer step)."""
        raise NotImplementedError

    @abc.abstractmethod
    def train_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step on ``input_``; returns at least ``update_successful``,
        ``grad_norm`` and ``lr``. See `LossFn` for the loss signature."""
        raise NotImplementedError

    @abc.abstractmethod
    def eval_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> torch.Tensor | None:
        """The weighted loss on ``input_`` without gradients."""
        raise NotImplementedError

    @abc.abstractmethod
    def forward(
        self,
        input_: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: PostHook | None = None,
        aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat,
    ) -> torch.Tensor:
        """Forward without gradients; per-sequence outputs in the original order."""
        raise NotImplementedError


class InferenceEngine(abc.ABC):
    """A generation engine serving rollouts and receiving weight updates."""

    @abc.abstractmethod
    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        """Connect to (or start) the serving processes."""
        raise NotImplementedError

    @abc.abstractmethod
    def destroy(self) -> None:
        """Stop workers and release resources."""
        raise NotImplementedError

    @abc.abstractmethod
    async def agenerate(self, req: LLMRequest) -> LLMResponse:
        """Generate a response for one request."""
        raise NotImplementedError

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> Future:
        """Start the receive half of a weight update; the Future resolves when it has landed."""
        raise NotImplementedError

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the weight version stamped on generated tokens."""
        raise NotImplementedError

    @abc.abstractmethod
    def get_version(self) -> int:
        """The current weight version."""
        raise NotImplementedError

    @abc.abstractmethod
    def submit(self, data: dict[str, Any], workflow: RolloutWorkflow) -> None:
        """Queue one episode of ``workflow`` on ``data`` for asynchronous rollout."""
        raise NotImplementedError

    @abc.abstractmethod
    def wait(
        self,
        count: int,
        timeout: float | None = None,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> TensorDict:
        """Wait for ``count`` accepted episodes and return them as one batch."""
        raise NotImplementedError

    @abc.abstractmethod
    def rollout_batch(self, data: list[dict[str, Any]], workflow: RolloutWorkflow) -> TensorDict:
        """Submit every item of ``data`` and wait for all of them."""
        raise NotImplementedError

    @abc.abstractmethod
    def prepare_batch(
        self,
        dataloader: StatefulDataLoader,
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> TensorDict:
        """Keep the rollout queue fed from ``dataloader`` and return the next full batch."""
        raise NotImplementedError

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop starting new generation work (e.g. during a weight update)."""
        raise NotImplementedError

    @abc.abstractmethod
    def resume(self) -> None:
        """Resume generation after `pause`."""
        raise NotImplementedError


class RolloutWorkflow(abc.ABC):
    """One episode of interaction with an inference engine."""

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict | None:
        """Run one episode on ``data``; return its trajectory, or None to reject the episode."""
        raise NotImplementedError


@dataclass
class InferenceEngineConfig:
    """Client-side rollout settings (AReaL's names). ``max_concurrent_rollouts`` defaults to
    ``consumer_batch_size`` and ``queue_size`` to 16 x ``max_concurrent_rollouts``."""

    max_concurrent_rollouts: int | None = None
    queue_size: int | None = None
    consumer_batch_size: int = 1
    max_head_offpolicyness: int = 0
    setup_timeout: float = 120.0
    request_timeout: float = 3600.0
    request_retries: int = 3
    server_addrs: list[str] = field(default_factory=list)
    admin_api_key: str | None = None
    retry_backoff: float = 0.2
    num_clients: int | None = None

    def __post_init__(self) -> None:
        if self.consumer_batch_size < 1:
            raise ValueError(f"InferenceEngineConfig.consumer_batch_size must be >= 1, got "
                             f"{self.consumer_batch_size}")
        if self.max_head_offpolicyness < 0:
            raise ValueError(f"InferenceEngineConfig.max_head_offpolicyness must be >= 0, got "
                             f"{self.max_head_offpolicyness}")
        if self.max_concurrent_rollouts is None:
            self.max_concurrent_rollouts = self.consumer_batch_size
        if self.queue_size is None:
            self.queue_size = 16 * self.max_concurrent_rollouts
        if self.max_concurrent_rollouts < 1 or self.queue_size < 1:
            raise ValueError("InferenceEngineConfig: max_concurrent_rollouts "
                             f"({self.max_concurrent_rollouts}) and queue_size ({self.queue_size}) "
                             "must be >= 1")
        if self.request_retries < 0:
            raise ValueError(f"InferenceEngineConfig.request_retries must be >= 0, got "
                             f"{self.request_retries}")
        if self.admin_api_key is None:
            self.admin_api_key = os.environ.get(ADMIN_KEY_ENV)
