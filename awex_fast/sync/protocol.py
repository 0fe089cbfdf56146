"""The adapter protocol of a weight-sync pair: the two Protocols RL frameworks drive, with the
exact members and arguments of AReaL's weight-update gateway, and the KV keys both sides of a
pair meet under (docs/DESIGN.md, "KV keys").

Contract (who calls what, in which order, what a failure leaves behind):

1. Every worker reports ``parallelism_strategy`` and ``get_weight_metadata()``, in *side-local*
   ranks (training: the global rank of the training job; inference: the rank inside its engine).
2. Whoever assembles the pair (`awex_fast.sync.pair.WeightSyncPair`, AReaL's gateway, or the
   controller-less join of `awex_fast.sync.join`) publishes the merged metadata of each side
   under the KV keys ``training_params_meta`` and ``infer_params_meta`` of the pair, as
   `awex_fast.sync.join.encode_side_metas` writes them: JSON with one base64 metas-JSON per
   engine (and one for the training job) plus the engine sizes, still side-local, and optionally
   the bucket size every rank must plan with.
3. ``init_weight_update_group(...)`` on every worker *concurrently*: each adapter fetches both
   values, shifts them to transfer ranks with ``with_rank_offset`` (engines first, by prefix sums
   of their sizes; training after every inference rank; `awex_fast.sync.join.assemble_world`),
   checks that the pieces published for its own transfer rank are the ones it reported, builds
   its own rank's plan (``plan.for_rank``; the world's plan is never built), mirrors
   ``plan_digest_rank{r}`` to the KV store, joins the transfer group and compares digests with
   its peers. ``master_port=0``: transfer rank 0 binds a port the OS chooses and publishes it
   under ``transfer_master_port`` (the driver must delete that key before re-forming a group).
4. ``batch_isend_irecv()`` on every worker concurrently: every sender sends its rank to every
   receiver of its plan; a dead or wrong peer fails here, not in the first update.
5. Each step, ``execute_weight_update(version)`` on every worker concurrently (never twice for
   one version). The inference side's ``version`` moves only after every bucket landed; a failed
   update raises `TransferError`, aborts the group and leaves the inference adapter *flagged*
   (``failed``, ``last_error``). The next update must first call
   ``teardown_weight_update_group()`` and ``init_weight_update_group(...)`` on a fresh port.

Colocated mode replaces 3-5 with ``init_colocate_weight_update`` and
``execute_colocate_weight_update`` (see `awex_fast.sync.colocate`). ``release_memory`` /
``resume_memory`` really free and restore memory (tags "weights", "optimizer" with an optimizer,
and any tag given a hook, such as an engine's "kv_cache"). Released training weights are resumed
for the duration of an update and released again. Released inference weights are not saved: the
engine refuses generation (`require_weights`) until the next update lands in them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

#: KV keys of a pair (docs/DESIGN.md "KV keys"); values are JSON, metas base64 inside (`awex_fast.sync.join`).
TRAINING_META_KEY = "training_params_meta"
INFER_META_KEY = "infer_params_meta"
MASTER_PORT_KEY = "transfer_master_port"
SIDE_METAS_FORMAT = "awex_fast.side_metas"
AREAL_DEFAULT_ADMIN_KEY = "areal-admin-key"


def digest_key(transfer_rank: int) -> str:
    """KV key where transfer rank ``transfer_rank`` mirrors its plan digest (docs/DESIGN.md, "KV keys")."""
    return f"plan_digest_rank{transfer_rank}"


class _AwexAdapter(Protocol):
    """The members both sides share, with the seed protocol's exact arguments."""

    @property
    def parallelism_strategy(self) -> dict:
        """world_size, tp_size, pp_size, dp_size, ep_size (and rank) of this worker's job/engine."""
        ...

    def get_weight_metadata(self) -> list:
        """This worker's pieces, canonical names, side-local rank: list[ParameterMeta]."""
        ...

    def get_local_shard_parameters(self, required_names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Canonical name -> this worker's local tensor or view (the memory the pieces index)."""
        ...

    def init_weight_update_group(self, pair_name: str, master_addr: str, master_port: int, transfer_rank: int,
                                 world_size: int, kv_store_url: str, infer_world_size: int,
                                 train_world_size: int, num_engines: int) -> None:
        """Pull peer metadata from the KV store, build this rank's plan, join the transfer group."""
        ...

    def execute_weight_update(self, version: int) -> None:
        """Run the cached plan (send, or receive and then move the version)."""
        ...

    def batch_isend_irecv(self, **kwargs: Any) -> None:
        """Warm-up exchange proving every peer of the plan answers."""
        ...

    def teardown_weight_update_group(self) -> None:
        """Leave the transfer group, drop cached state."""
        ...

    def init_colocate_weight_update(self, pair_name: str, kv_store_url: str, transfer_rank: int,
                                    infer_world_size: int, train_world_size: int, num_engines: int,
                                    master_port: int, admin_api_key: str = "areal-admin-key",
                                    timeout_s: float = 120.0) -> None:
        """Prepare colocated updates (handles through the KV store)."""
        ...

    def execute_colocate_weight_update(self, version: int) -> None:
        """Training: publish handles, wait for acks. Inference: map, copy, acknowledge."""
        ...

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free memory ("weights", "optimizer", "kv_cache", ...)."""
        ...

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Restore what release_memory freed."""
        ...


@runtime_checkable
class AwexTrainingAdapter(_AwexAdapter, Protocol):
    """Training side of a weight-sync pair (sends weights); see the module docstring."""


@runtime_checkable
class AwexInferenceAdapter(_AwexAdapter, Protocol):
    """Inference side of a weight-sync pair (receives weights); same members as the training side."""


class WeightsNotReadyError(RuntimeError):
    """Inference weights are released or the last update failed; generation must wait."""



__all__ = ["AREAL_DEFAULT_ADMIN_KEY", "INFER_META_KEY", "MASTER_PORT_KEY", "SIDE_METAS_FORMAT",
           "TRAINING_META_KEY", "AwexInferenceAdapter", "AwexTrainingAdapter", "WeightsNotReadyError",
           "digest_key"]
