"""Moving one rank's plan: `wire` cuts buckets into messages, `boxcopy` packs and unpacks boxes
(one native batched strided copy per message, casting), `executor` runs the pipelined exchange
through the strategy its transfer group declares: `staged` (isend / irecv of staging slots or
parameter memory) or `shared_slots` (packing into the receiver's shared slots, ipc), both over
`exchange` (messages per pair, bounded waits, checksums, trace); `simulate` runs a whole plan in
one process through the same pack / unpack code.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "Executor": "executor",
    "PlanMismatchError": "executor",
    "check_local_tensors": "executor",
    "wire_buckets": "wire",
    "simulate": "simulate",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
