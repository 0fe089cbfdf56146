"""FSDP2 (+TP) training engine on Hugging Face transformers models."""

from python_engines.train.config import FSDPEngineConfig, MicroBatchSpec, OptimizerConfig
from python_engines.train.engine import FSDPTrainEngine, WeightSyncNotWiredError

__all__ = [
    "FSDPEngineConfig",
    "FSDPTrainEngine",
    "MicroBatchSpec",
    "OptimizerConfig",
    "WeightSyncNotWiredError",
]
