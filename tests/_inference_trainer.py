"""A stand-alone training-side weight-sync worker for the inference tests.

``python tests/_inference_trainer.py <hf checkpoint> <url file>`` loads the checkpoint into a
plain transformers model, wraps it in ``awex_fast.sync.adapters.TrainingAdapter`` (one rank, gloo),
serves ``awex_fast.sync.routes.worker_app`` on 127.0.0.1 port 0, writes its URL to
``<url file>`` and serves until killed. The tests kill it to play a sender that dies.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from awex_fast.net import BackgroundServer
from awex_fast.sync import TrainingAdapter, worker_app


def main(checkpoint: str, url_file: str) -> None:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    adapter = TrainingAdapter(model, rank=0, world_size=1, timeout_s=60.0)
    server = BackgroundServer(lambda: worker_app(adapter), "127.0.0.1", 0).start()
    tmp = Path(f"{url_file}.{os.getpid()}.tmp")
    tmp.write_text(server.url)
    tmp.replace(url_file)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
