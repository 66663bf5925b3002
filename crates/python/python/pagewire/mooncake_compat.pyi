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
from typing import Optional, Sequence

class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2

class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9

class ReplicateConfig:
    replica_num: int
    nof_replica_num: int
    dfs_replica_num: int
    with_hard_pin: bool
    soft_pin_action: SoftPinAction
    soft_pin_ttl_ms: Optional[int]
    preferred_segment: str
    preferred_segments: List[str]
    preferred_nof_segments: List[str]
    prefer_alloc_in_same_node: bool
    group_ids: Optional[List[str]]
    data_type: ObjectDataType
    def __init__(self) -> None: ...

class MooncakeDistributedStore:
    def __init__(self) -> None: ...
    def setup(
        self,
        local_hostname: Any,
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = ...,
        local_buffer_size: int = ...,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int: ...
    def get_hostname(self) -> str: ...
    def health_check(self) -> int: ...
    def close(self) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def is_exist(self, key: str) -> int: ...
    def batch_is_exist(self, keys: Sequence[str]) -> List[int]: ...
    def get_size(self, key: str) -> int: ...
    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int: ...
    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int], config: Optional[ReplicateConfig] = None) -> List[int]: ...
    def batch_put_from_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], config: Optional[ReplicateConfig] = None) -> List[int]: ...
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]: ...
    def batch_get_into_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], prefer_alloc_in_same_node: bool = False) -> List[int]: ...
    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int: ...
    def get(self, key: str) -> bytes: ...
    def remove(self, key: str, force: bool = False) -> int: ...
    def batch_remove(self, keys: Sequence[str], force: bool = False) -> List[int]: ...
    def remove_all(self, force: bool = False) -> int: ...
# --- end store -------------------------------------------------------------------------
