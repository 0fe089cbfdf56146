"""The KV cache: one fixed-size slot per running sequence, per layer.

Why slots and not pages: the server's test and benchmark models are tiny and the batch is
bounded (``max_running``), so one contiguous ``[max_seq_len]`` strip per sequence keeps the
attention a single batched gather with no block tables. Layout per layer::

    k[i], v[i]: [num_slots + 1, max_seq_len, num_kv_heads_local, head_dim]

Slot ``num_slots`` is scratch: padded tokens of a ragged prefill batch write there, so they never
touch a live sequence. A sequence owns its slot from admission to completion (`SlotAllocator`);
the scheduler never reuses a slot before the request leaves the batch.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "SlotAllocator"]


class KVCache:
    """Per-layer K and V tensors; see the module docstring for the layout."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads_local: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """Allocate zeroed caches for ``num_slots`` sequences of up to ``max_seq_len`` tokens."""
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(
                f"KVCache needs num_slots >= 1 and max_seq_len >= 1, got {num_slots}, {max_seq_len}"
            )
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.shape = (num_slots + 1, max_seq_len, num_kv_heads_local, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    @property
    def scratch_slot(self) -> int:
        """The slot padded tokens write to."""
        return self.num_slots

    @property
    def allocated(self) -> bool:
        """False after `release` until `allocate`."""
        return bool(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self) -> None:
        """(Re)allocate the tensors, zeroed; no-op when already allocated."""
        if self.allocated:
            return
        self.k = [
            torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.v = [
            torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]

    def release(self) -> None:
        """Drop the tensors (``release_memory(tags=["kv_cache"])``); every sequence is lost."""
        self.k, self.v = [], []


class SlotAllocator:
    """Free list of cache slots; lowest free slot first, so runs are reproducible."""

    def __init__(self, num_slots: int) -> None:
        """All ``num_slots`` slots start free."""
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Slots not owned by any sequence."""
        return len(self._free)

    def take(self) -> int:
        """Claim a free slot; raises RuntimeError when none is left."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} KV cache slots are in use")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        """Return ``slot`` to the free list; raises ValueError for a slot that is already free."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not an owned slot of [0, {self.num_slots})")
        self._free.append(slot)
        self._free.sort(reverse=True)
