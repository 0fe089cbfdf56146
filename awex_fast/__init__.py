"""awex_fast: fast, verified weight synchronization from sharded training to sharded inference.

See DESIGN.md for the vocabulary (transfer ranks, canonical names, shard pieces, plans) and the
public API contract. The native core (awex_fast._C) does planning and copying; this package
validates inputs and moves torch tensors' memory through it.
"""

from awex_fast import copy
from awex_fast._native import build_info
from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta, ShardRule

__version__ = build_info()["version"]

__all__ = [
    "MetadataError",
    "ParameterMeta",
    "ShardMeta",
    "ShardRule",
    "__version__",
    "build_info",
    "copy",
]
