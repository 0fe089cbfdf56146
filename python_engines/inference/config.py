"""`ServerConfig`: the inference server's settings, passed to every worker process as one JSON
argument (never pickled)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServerConfig"]


@dataclass
class ServerConfig:
    """Everything a worker process needs, as JSON. ``model_path``: an HF directory (weights
    loaded from it); else ``hf_config`` (a config.json dict) with random weights from ``seed``
    (normal with ``initializer_range``, default the config's, else 0.02)."""

    model_path: str | None = None
    hf_config: dict[str, Any] | None = None
    tp_size: int = 1
    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"
    max_seq_len: int = 1024
    max_running: int = 32
    seed: int = 0
    initializer_range: float | None = None
    num_threads: int = 1
    version: int = 0
    group_timeout_s: float = 600.0
    heartbeat_s: float = 5.0
    transfer_backend: str | None = None
    transfer_timeout_s: float = 120.0
    bucket_bytes: int = 256 << 20
    gang_timeout_s: float = 60.0
    run_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model_path is None) == (self.hf_config is None):
            raise ValueError("ServerConfig needs exactly one of model_path and hf_config")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"ServerConfig.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"ServerConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.tp_size < 1 or self.max_running < 1 or self.max_seq_len < 2:
            raise ValueError(f"ServerConfig: tp_size ({self.tp_size}), max_running ({self.max_running}) "
                             f"must be >= 1 and max_seq_len ({self.max_seq_len}) >= 2")

    def read_hf_config(self) -> dict[str, Any]:
        """The model's config.json as a dict."""
        if self.hf_config is not None:
            return dict(self.hf_config)
        return json.loads((Path(str(self.model_path)) / "config.json").read_text())
