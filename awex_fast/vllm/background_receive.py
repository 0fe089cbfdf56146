"""A vLLM worker's receive of one round on a thread of its own, while vLLM keeps serving.

`awex_fast.vllm.worker` starts one at ``start_weight_update`` (receiving while serving) and joins
it at ``update_weights``. The thread touches only the transfer group's sockets and the staging
buffers, which the model never reads and nothing else writes until `BackgroundReceive.finish`
has joined it (on CUDA it runs on a side stream of its own, so the engine's stream keeps
computing; never run on a GPU yet). vLLM's own process groups are never used from it (the
engine's agreement on the outcome runs on the worker's main thread afterwards), since vLLM's
collectives on the main thread would interleave with ours.
"""

from __future__ import annotations

import threading
import time

import torch

from awex_fast.sync import InferenceAdapter
from awex_fast.transport import TransferError

__all__ = ["BackgroundReceive"]


class BackgroundReceive:
    """One round received on a thread of its own while vLLM keeps serving: the transfer group's
    sockets and the staging buffers only, which nothing else touches until `finish` joined it."""

    def __init__(self, adapter: InferenceAdapter, rnd: int, who: str,
                 device: torch.device | None = None) -> None:
        self.round, self.who = rnd, who
        self.device = device
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(adapter,), daemon=True,
                                        name=f"awex-receive-{rnd}")
        self._thread.start()

    def _run(self, adapter: InferenceAdapter) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                # a side stream: the thread's default would be the legacy default stream, which
                # serializes with the engine's compute; synchronized before the round counts as in
                stream = torch.cuda.Stream(device=self.device)
                with torch.cuda.stream(stream):
                    adapter.execute_weight_update(self.round)
                stream.synchronize()
            else:
                adapter.execute_weight_update(self.round)
        except BaseException as exc:  # noqa: BLE001 - handed to the update RPC
            self.error = exc
        self.seconds = time.perf_counter() - self.started

    def wait(self, timeout: float) -> bool:
        """Whether the receive has ended (successfully or not) within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def finish(self, version: int, timeout: float) -> None:
        """Wait for the receive of ``version``; raises its error, or `TransferError` when the
        update names another round or the bytes did not arrive within ``timeout``."""
        if version != self.round:
            raise TransferError(f"{self.who}: the update names round {version}, but round {self.round} "
                                "was announced and is being received")
        if not self.wait(timeout):
            raise TransferError(f"{self.who}: round {version} did not arrive within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
