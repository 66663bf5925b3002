"""Type stubs for pagewire.mooncake_compat (Mooncake's TransferEngine on pagewire)."""

import enum
from typing import Any, List

from pagewire._native import _MooncakeTransfers

SUPPORT_CUDA: bool
SUPPORT_EFA: bool
SUPPORT_HIP: bool
SUPPORT_MNNVL: bool
SUPPORT_MUSA: bool
SUPPORT_INTRA_NVLINK: bool

class TransferOpcode:
    """pybind11-style enum: equal only to its members, not to ints."""
    Read: TransferOpcode
    Write: TransferOpcode
    __members__: dict[str, TransferOpcode]
    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...

Read: TransferOpcode
Write: TransferOpcode

class TransferNotify:
    name: str
    msg: str
    def __init__(self, name: str = "", msg: str = "") -> None: ...

class InnerTransferEngine:
    def __init__(self, owner: TransferEngine) -> None: ...

class TransferEngine(_MooncakeTransfers):
    TransferOpcode: type[TransferOpcode]
    def get_notifies(self) -> List[TransferNotify]: ...
    def get_engine(self) -> Any: ...
    def warmup_efa_segment(self, segment_name: str) -> int: ...
    def __enter__(self) -> TransferEngine: ...
    def __exit__(self, *exc: Any) -> None: ...
    def transfer_write_on_cuda(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        stream_ptr: int = 0, transport_hint: str = "",
    ) -> None: ...
    def transfer_read_on_cuda(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        stream_ptr: int = 0, transport_hint: str = "",
    ) -> None: ...
    def batch_transfer_write_on_cuda(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], stream_ptr: int = 0, transport_hint: str = "",
    ) -> None: ...
    def batch_transfer_read_on_cuda(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], stream_ptr: int = 0, transport_hint: str = "",
    ) -> None: ...

# --- RpcInterface, SharedSegment (pagewire._mooncake_rpc, pagewire._mooncake_shm) -------
from pagewire._mooncake_rpc import (
    CoroRPCInterface as CoroRPCInterface,
    ReceivedData as ReceivedData,
    ReceivedTensor as ReceivedTensor,
    RpcInterface as RpcInterface,
    create_rpc_client as create_rpc_client,
    create_rpc_server as create_rpc_server,
)
from pagewire._mooncake_shm import SharedSegment as SharedSegment

# --- store: mooncake.store.MooncakeDistributedStore on the pagewire store --------------
# The implementation modules are annotated; their types are the stubs.
from pagewire._mooncake_store import MooncakeDistributedStore as MooncakeDistributedStore
from pagewire._mooncake_store import ObjectDataType as ObjectDataType
from pagewire._mooncake_store import ReplicateConfig as ReplicateConfig
from pagewire._mooncake_store import SoftPinAction as SoftPinAction
# --- end store -------------------------------------------------------------------------
