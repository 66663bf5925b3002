"""What ``import mooncake.store`` gives with ``PAGEWIRE_AS_MOONCAKE=1``: Mooncake Store's
Python names, over the pagewire store (every public name of Mooncake's wheel; what
pagewire answers differently is listed in docs/python.md).

>>> import pagewire.mooncake_store as store
>>> store.ReplicateConfig().replica_num
1
>>> store.KVCACHE, store.COMPLETE
(<ObjectDataType.KVCACHE: 1>, <ReplicaStatus.COMPLETE: 3>)
>>> store.NoSuchThing
Traceback (most recent call last):
...
AttributeError: pagewire does not provide mooncake.store.NoSuchThing (PAGEWIRE_AS_MOONCAKE=1 answers mooncake.store with pagewire.mooncake_store; docs/python.md lists what it has)

The store classes are those of :mod:`pagewire.mooncake_compat` (one class, two names).
As in Mooncake's module, the members of ``ObjectDataType``, ``ReplicaStatus``,
``TaskStatus`` and ``TaskType`` are also module attributes (a name two enums share is
the later one's: ``FAILED`` and ``PROCESSING`` are ``TaskStatus``'s). A name this module
lacks raises an ``AttributeError`` that says so, so ``from mooncake.store import X``
fails at the import with the name, not later.
"""

from pagewire._mooncake_store import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)
from pagewire._mooncake_store_types import (
    BufferHandle,
    BufferLease,
    BufferLeaseView,
    BufferPool,
    Descriptor,
    DiskDescriptor,
    EngramStore,
    EngramStoreConfig,
    MemoryDescriptor,
    MooncakeDistributedNoFRegister,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
)

__all__ = [
    "BufferHandle", "BufferLease", "BufferLeaseView", "BufferPool", "Descriptor",
    "DiskDescriptor", "EngramStore", "EngramStoreConfig", "MemoryDescriptor",
    "MooncakeDistributedNoFRegister", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
    "ObjectDataType", "ParallelAxis", "QueryTaskResponse", "ReadTarget",
    "RegisteredBufferLease", "RegisteredBufferLeaseView", "RegisteredBufferPool",
    "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus",
    "TaskType", "TensorParallelism", "bind_to_numa_node", "get_alloc_func_addr",
    "get_free_func_addr",
]  # fmt: skip

# Mooncake's module exports these enums' members too, in this order.
for _enum in (ObjectDataType, ReplicaStatus, TaskStatus, TaskType):
    for _member in _enum:
        globals()[_member.name] = _member
        if _member.name not in __all__:
            __all__.append(_member.name)
del _enum, _member


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"pagewire does not provide mooncake.store.{name} (PAGEWIRE_AS_MOONCAKE=1 answers "
        "mooncake.store with pagewire.mooncake_store; docs/python.md lists what it has)"
    )
