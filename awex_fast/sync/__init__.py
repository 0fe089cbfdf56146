"""Weight sync around the transfer: the adapter protocol (`TrainingAdapter`, `InferenceAdapter`)
and its awex implementations, `WeightSyncPair` with its workers and HTTP gateway, the worker
routes, and colocated mode (weights shared through memory segments on one host).

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "TRAINING_META_KEY": "adapters",
    "INFER_META_KEY": "adapters",
    "AwexTrainingAdapter": "adapters",
    "AwexInferenceAdapter": "adapters",
    "WeightsNotReadyError": "adapters",
    "TrainingAdapter": "adapters",
    "InferenceAdapter": "adapters",
    "encode_side_metas": "adapters",
    "decode_side_metas": "adapters",
    "PairError": "pair",
    "WorkerError": "pair",
    "LocalWorker": "pair",
    "HttpWorker": "pair",
    "KVWorker": "pair",
    "serve_kv_worker": "pair",
    "WeightSyncPair": "pair",
    "gateway_app": "pair",
    "gateway_main": "pair",
    "MAX_BODY_BYTES": "routes",
    "WorkerCallError": "routes",
    "worker_routes": "routes",
    "worker_app": "routes",
    "ColocateError": "colocate",
    "share_tensors": "colocate",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
