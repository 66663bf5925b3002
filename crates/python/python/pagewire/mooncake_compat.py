"""Mooncake's Python surfaces on pagewire, for callers written against Mooncake.

Every class keeps Mooncake's method names, argument names, defaults and return codes;
peers must be pagewire too (API-compatible, not wire-compatible).

>>> from pagewire.mooncake_compat import MooncakeDistributedStore
>>> MooncakeDistributedStore().get_hostname()   # before setup
''
"""

# --- store: mooncake.store.MooncakeDistributedStore on the pagewire store --------------
from pagewire._mooncake_store import (  # noqa: E402
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ObjectDataType"]
# --- end store -------------------------------------------------------------------------
