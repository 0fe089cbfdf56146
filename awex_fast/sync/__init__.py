"""Weight sync around the transfer: the adapter protocol and its KV keys (`protocol`), its awex
implementations (`adapters` over `adapter_base`), the one join every driver runs (`join`),
`WeightSyncPair` (`pair`) with its worker channels (`workers`) and HTTP gateway (`gateway`), the
worker routes, and colocated mode (weights shared through memory segments on one host).

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    # the protocol and its KV keys
    "TRAINING_META_KEY": "protocol",
    "INFER_META_KEY": "protocol",
    "MASTER_PORT_KEY": "protocol",
    "digest_key": "protocol",
    "AwexTrainingAdapter": "protocol",
    "AwexInferenceAdapter": "protocol",
    "WeightsNotReadyError": "protocol",
    # the awex adapters
    "TrainingAdapter": "adapters",
    "InferenceAdapter": "adapters",
    # the one join
    "JoinError": "join",
    "JoinTimeoutError": "join",
    "World": "join",
    "encode_side_metas": "join",
    "decode_side_metas": "join",
    "assemble_world": "join",
    "check_own_pieces": "join",
    "read_report": "join",
    "merge_per_engine": "join",
    "gather_rank_metas": "join",
    "reset_group_keys": "join",
    "publish_side": "join",
    "put_side": "join",
    "wait_side": "join",
    "wait_value": "join",
    "run_step": "join",
    "check_digests": "join",
    "form_transfer_group": "join",
    # the controller, its worker channels and its HTTP gateway
    "PairError": "pair",
    "WeightSyncPair": "pair",
    "WorkerError": "workers",
    "LocalWorker": "workers",
    "HttpWorker": "workers",
    "KVWorker": "workers",
    "serve_kv_worker": "workers",
    "gateway_app": "gateway",
    "gateway_main": "gateway",
    # worker routes, colocated mode
    "MAX_BODY_BYTES": "routes",
    "WorkerCallError": "routes",
    "worker_routes": "routes",
    "worker_app": "routes",
    "ColocateError": "colocate",
    "share_tensors": "colocate",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
