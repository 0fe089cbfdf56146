"""`AwexFastTrainerInitInfo`: what every trainer rank gives ``trainer_init`` (vLLM's NCCL names
accepted as they are), and how it resolves the number of trainer ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from awex_fast.transport import BACKENDS
from awex_fast.vllm.trainer_group import default_group_size
from awex_fast.vllm.worker import LOAD_MODES

__all__ = ["AwexFastTrainerInitInfo"]


@dataclass
class AwexFastTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of backend ``"awex_fast"``. Only ``rank`` is required; the rest
    defaults to one host. The first three fields are those of vLLM's `NCCLTrainerInitInfo`, with
    the same names and order, so a vLLM example runs with only the class swapped.

    ``master_address``: where inference transfer rank 0 binds the transfer group's rendezvous
    (``master_addr`` is the old name, kept as an alias); default: the first vLLM server's host when
    it is another host, else loopback (`awex_fast.vllm.addresses`). ``master_port``: that
    rendezvous's port for the first join (0: a free port, chosen there; a re-join after a failure
    always picks a fresh one). ``world_size``: the number of trainer ranks; default: the default
    process group's size (1 without one). vLLM's own meaning, trainer ranks + vLLM workers, is
    accepted too, and checked once the workers are known; any other number is refused naming both.
    ``packed``, ``packed_buffer_size_bytes``, ``packed_num_buffers``: accepted for vLLM's NCCL init-
    info compatibility and ignored (awex_fast always packs, by ``bucket_bytes``).

    ``transport``: "gloo" (default for CPU weights), "nccl" (default for CUDA weights),
    "native-nccl" or "ipc" (shared memory, one host). ``kv_store_url`` / ``admin_api_key`` /
    ``pair``: an existing awex_fast KV store and the pair name to meet under (default: rank 0
    hosts one on ``kv_host``, with a fresh key and pair name; ``kv_host`` defaults to the address
    this host reaches the first remote vLLM server by, else loopback). ``load_mode``: "auto", "staged" or
    "inplace" (`awex_fast.vllm.worker`). ``timeout_s`` bounds every wait. ``fp8_quantize``: into a
    block-FP8 vLLM model, "trainer" (default) quantizes on the trainer ranks and sends e4m3 +
    scales (`awex_fast.vllm.fp8_sender`; needs a default process group over the trainer ranks,
    else it falls back), "engine" sends the trainer's dtype and the workers quantize
    (`awex_fast.vllm.fp8_layout`). ``receive_while_serving`` (default True): the workers receive
    each round in the background between ``start_weight_update`` and ``update_weights`` while
    vLLM keeps generating on the previous version, and only applying it stops generation
    (`awex_fast.vllm.worker`); False receives inside ``update_weights`` (vLLM stands still for the
    whole round). It needs staging buffers, so it cannot be combined with ``load_mode="inplace"``."""

    backend: ClassVar[str] = "awex_fast"

    master_address: str | None = None
    master_port: int = 0
    world_size: int | None = None
    packed: bool = True
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None
    transport: str | None = None
    kv_store_url: str | None = None
    kv_host: str | None = None
    admin_api_key: str | None = None
    pair: str | None = None
    timeout_s: float = 300.0
    bucket_bytes: int = 256 << 20
    load_mode: str = "auto"
    verify: bool = False
    fp8_quantize: str = "trainer"
    receive_while_serving: bool = True
    master_addr: str | None = None  # the old name of master_address

    def __post_init__(self) -> None:
        if self.master_addr is not None:
            if self.master_address not in (None, self.master_addr):
                raise ValueError(f"master_addr {self.master_addr!r} and master_address "
                                 f"{self.master_address!r} disagree; give master_address only")
            self.master_address = self.master_addr
        self.master_addr = self.master_address
        if int(self.rank) < 0:
            raise ValueError(f"trainer rank {self.rank} is negative")
        if self.world_size is not None and not 0 <= int(self.rank) < int(self.world_size):
            raise ValueError(f"trainer rank {self.rank} outside world_size {self.world_size}")
        if not 0 <= int(self.master_port) < 65536:
            raise ValueError(f"master_port must be a TCP port (0 for a free one), got {self.master_port}")
        if self.transport is not None and self.transport not in BACKENDS:
            raise ValueError(f"transport must be one of {BACKENDS}, got {self.transport!r}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}")
        if self.fp8_quantize not in ("trainer", "engine"):
            raise ValueError(f"fp8_quantize must be 'trainer' or 'engine', got {self.fp8_quantize!r}")
        if self.receive_while_serving and self.load_mode == "inplace":
            raise ValueError("load_mode 'inplace' receives into the live weights, which vLLM reads while it "
                             "serves; give receive_while_serving=False with it, or load_mode 'staged'/'auto'")

    def trainer_world(self) -> tuple[int, int | None]:
        """(the number of trainer ranks, a given ``world_size`` still to be checked against
        trainer ranks + vLLM workers once those are known, or None)."""
        group = default_group_size()
        given = None if self.world_size is None else int(self.world_size)
        if group is not None:
            return group, (given if given not in (None, group) else None)
        if given is None or given == 1:
            return 1, None
        if self.kv_store_url and self.pair:  # ranks that meet through a given store: trust the count
            return given, None
        return 1, given  # a lone trainer process (nothing else could share the KV store with it)
