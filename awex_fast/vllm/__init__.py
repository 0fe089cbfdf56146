"""awex_fast as a vLLM weight-transfer backend, registered under the name ``"awex_fast"``.

Server side, one flag (and ``VLLM_SERVER_DEV_MODE=1`` for the HTTP weight-sync routes)::

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --weight-transfer-config '{"backend": "awex_fast"}'

vLLM's processes find the backend through the ``vllm.general_plugins`` entry point that this
package installs (`register`); a trainer process registers it by importing this module::

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)
    from awex_fast.vllm import AwexFastTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=r, world_size=W),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()      # every trainer rank, every round; engine.shutdown() at the end

`awex_fast.vllm.worker` (inside vLLM) and `awex_fast.vllm.trainer` (in the trainer) say what
each half does; `awex_fast.vllm.layout` how the destination layout is learned from vLLM's own
loaders; `awex_fast.vllm.rendezvous` how the two sides meet.
"""

from __future__ import annotations

from awex_fast.vllm.clients import AsyncLLMWeightSyncClient, GenerationHold, LLMWeightSyncClient
from awex_fast.vllm.trainer import (
    AwexFastTrainerInitInfo,
    AwexFastTrainerWeightTransferEngine,
    SendError,
    ShardedSource,
)
from awex_fast.vllm.worker import AwexFastUpdateInfo, AwexFastWeightTransferEngine, AwexFastWorkerInitInfo

BACKEND_NAME = "awex_fast"

__all__ = [
    "BACKEND_NAME",
    "AsyncLLMWeightSyncClient",
    "AwexFastTrainerInitInfo",
    "AwexFastTrainerWeightTransferEngine",
    "AwexFastUpdateInfo",
    "AwexFastWeightTransferEngine",
    "AwexFastWorkerInitInfo",
    "GenerationHold",
    "LLMWeightSyncClient",
    "SendError",
    "ShardedSource",
    "register",
]


def register() -> None:
    """Register backend ``"awex_fast"`` in vLLM's worker and trainer factories (idempotent).
    This is the ``vllm.general_plugins`` entry point, run in every vLLM process."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, AwexFastWeightTransferEngine)
    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, AwexFastTrainerWeightTransferEngine)
    __import__("awex_fast.vllm.baselines", fromlist=["register"]).register()
    from awex_fast.vllm import cpu_fp8, draft

    draft.install()
    cpu_fp8.install()  # only with AWEX_FAST_CPU_FP8_FALLBACK=1, on a CPU platform


register()
