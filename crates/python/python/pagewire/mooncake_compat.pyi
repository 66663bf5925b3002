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

class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1

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
    def free_managed_buffer(self, buffer_addr: int, length: int, /) -> int: ...
    def write_bytes_to_buffer(self, dest_address: int, src: str, length: int, /) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int, /) -> bytes: ...
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

# --- store: mooncake.store.MooncakeDistributedStore on the pagewire store --------------
# The implementation modules are annotated; their types are the stubs.
from pagewire._mooncake_store import MooncakeDistributedStore as MooncakeDistributedStore
from pagewire._mooncake_store import ObjectDataType as ObjectDataType
from pagewire._mooncake_store import ReplicateConfig as ReplicateConfig
from pagewire._mooncake_store import SoftPinAction as SoftPinAction
# --- end store -------------------------------------------------------------------------
