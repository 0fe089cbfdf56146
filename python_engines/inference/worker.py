"""One TP rank of an inference server: the model, its KV cache, and the collective ops.

Why an op protocol: every TP rank must run the same forward pass and the same weight update
at the same step boundary, but only rank 0 serves HTTP and schedules. So rank 0 decides, and
*broadcasts* each op over a private gloo control group before running it itself; ranks 1..N-1
loop on `Worker.follow`, receive ops and run them. Control is JSON (length, then UTF-8 bytes, as
uint8 tensors, see `Worker.broadcast_op`); a forward pass's inputs travel as int64 bytes in
the same frame. Nothing is pickled.

Ops (``header["op"]``):

- ``forward``: ``B``, ``T`` in the header; int64 payload ``[3 * B * T + 2 * B]`` = tokens,
  positions and write slots (``[B, T]`` each, flattened), then read slots and logit index.
  Every rank computes the full logits (vocab-parallel lm_head, then an all-gather).
- ``load_disk``: ``path``: each rank reads its boxes of an HF checkpoint. Results are gathered.
- ``adapter``: ``calls``, one ``{"method", "kwargs"}`` (or None) per rank: call that method of
  this rank's awex_fast `InferenceAdapter` (weight-sync group, updates, memory release; the
  ``kv_cache`` tag frees the KV cache). All ranks run their call at the same step boundary.
- ``noop`` (heartbeat while idle, so no rank waits past the group timeout) and ``shutdown``.

Ops other than ``forward`` end with `Worker.gather_results`: every rank reports
``{"ok": bool, "error": str | None, "value": ...}`` and rank 0 sees them all, so a failure on rank 3 is
reported as rank 3's.
"""

from __future__ import annotations

import json
import logging
import struct
import traceback
from typing import Any

import torch
import torch.distributed as dist

from awex_fast.meta import metas_to_b64
from python_engines.inference.kv_cache import KVCache
from python_engines.inference.model import ModelArgs, Transformer
from python_engines.inference.tp import TPContext
from python_engines.inference.weights import (
    init_random_weights,
    load_hf_weights,
    view_dict,
    weight_metas,
)

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: Bytes of the first (fixed-size) broadcast of every op.
_FRAME = 4096

#: Adapter methods the ``adapter`` op may call (the mutating half of the awex protocol).
_ADAPTER_METHODS = ("init_weight_update_group", "execute_weight_update", "batch_isend_irecv",
                    "teardown_weight_update_group", "init_colocate_weight_update",
                    "execute_colocate_weight_update", "release_memory", "resume_memory")


class Worker:
    """Model, KV cache and op execution of one TP rank; see the module docstring.

    ``config`` is the server's JSON config (see `python_engines.inference.config.ServerConfig`).
    Call after the default process group exists (``backend`` gloo on CPU, nccl on GPU).
    """

    def __init__(self, config: dict[str, Any], hf_config: dict[str, Any]) -> None:
        """Build the model (random or from ``config["model_path"]``) and the KV cache."""
        self.config = config
        self.rank = dist.get_rank()
        self.tp_size = dist.get_world_size()
        self.control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        if config["backend"] == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.dtype = _DTYPES[config["dtype"]]
        self.args = ModelArgs.from_hf_config(hf_config)
        self.tp = TPContext(self.rank, self.tp_size, None)
        max_len = int(config["max_seq_len"])
        with torch.device(self.device):
            self.model = Transformer(self.args, self.tp, max_len, self.dtype)
        self.model.eval()
        if config.get("model_path"):
            load_hf_weights(self.model, config["model_path"])
        else:
            std = config.get("initializer_range") or hf_config.get("initializer_range", 0.02)
            init_random_weights(self.model, int(config["seed"]), float(std))
        kv_heads = self.model.shapes.num_kv_heads_local
        self.cache = KVCache(self.args.num_layers, int(config["max_running"]), max_len, kv_heads,
                             self.args.head_dim, self.dtype, self.device)
        self.adapter = self._build_adapter(config)

    def _build_adapter(self, config: dict[str, Any]) -> Any:
        """This rank's awex_fast `InferenceAdapter` over the canonical views of the model; the
        ``kv_cache`` memory tag releases and re-allocates the KV cache."""
        from awex_fast.sync import InferenceAdapter

        backend = config.get("transfer_backend") or ("nccl" if config["backend"] == "nccl" else "gloo")
        return InferenceAdapter(
            lambda: view_dict(self.model),
            metas=lambda: weight_metas(self.model), rank=self.rank, engine_size=self.tp_size,
            backend=backend, timeout_s=float(config["transfer_timeout_s"]),
            bucket_bytes=int(config["bucket_bytes"]),
            release_hooks={"kv_cache": (self.cache.release, self.cache.allocate)})

    # ------------------------------------------------------------------------------ channel

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.broadcast(t, src=0, group=self.control)
        return t

    def broadcast_op(self, header: dict[str, Any], data: torch.Tensor | None = None) -> None:
        """Rank 0: announce an op (and its int64 payload) to every other rank.

        Wire format: one `_FRAME`-byte uint8 broadcast ``[json_len, data_len (int64 each) |
        JSON | int64 data]``; whatever does not fit follows in a second broadcast of exactly
        the remaining bytes. A decode step of up to ~100 requests is one broadcast.
        """
        if self.tp_size == 1:
            return
        raw = json.dumps(header).encode()
        payload = b"" if data is None else data.to(torch.long).cpu().contiguous().numpy().tobytes()
        message = struct.pack("<qq", len(raw), len(payload)) + raw + payload
        frame = torch.zeros(_FRAME, dtype=torch.uint8)
        head = message[:_FRAME]
        frame[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._bcast(frame)
        if len(message) > _FRAME:
            self._bcast(torch.frombuffer(bytearray(message[_FRAME:]), dtype=torch.uint8))

    def receive_op(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Ranks > 0: wait for rank 0's next op (see `broadcast_op` for the wire format)."""
        frame = bytes(self._bcast(torch.zeros(_FRAME, dtype=torch.uint8)).numpy())
        json_len, data_len = struct.unpack("<qq", frame[:16])
        total = 16 + json_len + data_len
        message = frame[:total]
        if total > _FRAME:
            rest = self._bcast(torch.empty(total - _FRAME, dtype=torch.uint8))
            message = frame + bytes(rest.numpy())
        header = json.loads(message[16 : 16 + json_len])
        data = None
        if data_len:
            data = torch.frombuffer(bytearray(message[16 + json_len :]), dtype=torch.long)
        return header, data

    def gather_results(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's JSON result, in rank order (collective)."""
        if self.tp_size == 1:
            return [result]
        raw = json.dumps(result).encode()
        n = torch.tensor([len(raw)], dtype=torch.long)
        lens = [torch.zeros(1, dtype=torch.long) for _ in range(self.tp_size)]
        dist.all_gather(lens, n, group=self.control)
        width = int(max(int(x) for x in lens))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.tp_size)]
        dist.all_gather(parts, buf, group=self.control)
        return [json.loads(bytes(p[: int(k)].numpy())) for p, k in zip(parts, lens, strict=True)]

    # ------------------------------------------------------------------------------ ops

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                read_slots: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
        """Rank 0: broadcast a forward op and run it; returns logits ``[B, vocab]`` float32."""
        B, T = tokens.shape
        packed = torch.cat([tokens.flatten(), positions.flatten(), write_slots.flatten(), read_slots,
                            logit_index])
        self.broadcast_op({"op": "forward", "B": B, "T": T}, packed)
        return self._forward_packed(B, T, packed)

    def _forward_packed(self, B: int, T: int, packed: torch.Tensor) -> torch.Tensor:
        if not self.cache.allocated:
            raise RuntimeError(f"TP rank {self.rank}: the KV cache is released; resume_memory first")
        packed = packed.to(self.device)
        n = B * T
        tokens, positions, write = (packed[i * n : (i + 1) * n].view(B, T) for i in range(3))
        read, last = packed[3 * n : 3 * n + B], packed[3 * n + B :]
        ctx = self.model.step_context(positions, write, read)
        return self.model(tokens, ctx, self.cache, last)

    def run_local(self, header: dict[str, Any]) -> dict[str, Any]:
        """Run a non-forward op on this rank; never raises (errors are reported in the result)."""
        op = header["op"]
        handler = {"load_disk": self._op_load_disk, "adapter": self._op_adapter,
                   "noop": lambda header: None}.get(op, self._unknown_op)
        try:
            value = handler(header)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which decides
            logger.warning("rank %d: op %s failed: %s", self.rank, op, exc)
            return {"ok": False, "error": f"TP rank {self.rank}: {type(exc).__name__}: {exc}",
                    "type": type(exc).__name__, "traceback": traceback.format_exc(limit=8)}
        return {"ok": True, "error": None, "value": value}

    @staticmethod
    def _unknown_op(header: dict[str, Any]) -> None:
        raise ValueError(f"unknown op {header['op']!r}")

    def _op_load_disk(self, header: dict[str, Any]) -> int:
        self.adapter.resume_memory(["weights"])  # no-op unless released: the load needs the memory
        return load_hf_weights(self.model, header["path"])

    def _op_adapter(self, header: dict[str, Any]) -> Any:
        """Call ``calls[rank]`` = ``{"method", "kwargs"}`` on this rank's adapter (None: idle)."""
        call = header["calls"][self.rank]
        if call is None:
            return None
        method, kwargs = call["method"], call.get("kwargs") or {}
        if method == "get_weight_metadata":
            return metas_to_b64(self.adapter.get_weight_metadata())
        if method not in _ADAPTER_METHODS:
            raise ValueError(f"adapter method {method!r} is not callable over the op channel")
        return getattr(self.adapter, method)(**kwargs)

    def run_collective(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        """Rank 0: broadcast a non-forward op, run it here, and return every rank's result."""
        self.broadcast_op(header)
        return self.gather_results(self.run_local(header))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's ops until ``shutdown`` (or the group breaks)."""
        while True:
            header, data = self.receive_op()
            op = header["op"]
            if op == "shutdown":
                return
            if op == "forward":
                assert data is not None
                self._forward_packed(int(header["B"]), int(header["T"]), data)
                continue
            self.gather_results(self.run_local(header))
