"""What ``import mooncake.store`` gives with ``PAGEWIRE_AS_MOONCAKE=1``: Mooncake Store's
Python names that pagewire implements, over the pagewire store.

>>> import pagewire.mooncake_store as store
>>> store.ReplicateConfig().replica_num
1
>>> store.BufferPool
Traceback (most recent call last):
...
AttributeError: pagewire does not provide mooncake.store.BufferPool (PAGEWIRE_AS_MOONCAKE=1 answers mooncake.store with pagewire.mooncake_store; docs/python.md lists what it has)

The classes are those of :mod:`pagewire.mooncake_compat` (one class, two names). A name
that Mooncake's module has and this one lacks raises an ``AttributeError`` that says so,
so ``from mooncake.store import X`` fails at the import with the name, not later.
"""

from pagewire._mooncake_store import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = [
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ObjectDataType",
    "ReplicateConfig",
    "SoftPinAction",
]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"pagewire does not provide mooncake.store.{name} (PAGEWIRE_AS_MOONCAKE=1 answers "
        "mooncake.store with pagewire.mooncake_store; docs/python.md lists what it has)"
    )
