"""A drop-in for ``mooncake.engine``: Mooncake's ``TransferEngine`` on pagewire.

Every method SGLang and vLLM call has Mooncake's name, argument names, defaults and
return codes; session ids are ``"host:rpc_port"`` with the port in Mooncake's RPC range
(15000-17000, ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``). Peers must be pagewire engines
too (API-compatible, not wire-compatible).

>>> from pagewire.mooncake_compat import TransferEngine
>>> te = TransferEngine()
>>> te.get_rpc_port()          # before initialize: -1, not a crash
-1

Where Mooncake is lax, pagewire is strict: every local and remote range of a batch is
checked before anything is posted (an unregistered source fails with -1 and nothing is
written), raw addresses are checked to be writable memory before they are registered, a
method called before ``initialize`` returns -1, an unknown metadata server returns -1,
a stale batch id returns -1, and ``send_probe`` gives up within 5 s.

With ``PAGEWIRE_AS_MOONCAKE=1`` in the environment, ``import mooncake.engine`` gives this
module (an import hook the wheel installs), so unchanged SGLang and vLLM code uses it.
"""

from __future__ import annotations

from typing import Any, List

from pagewire._mooncake_rpc import (
    CoroRPCInterface,
    ReceivedData,
    ReceivedTensor,
    RpcInterface,
    create_rpc_client,
    create_rpc_server,
)
from pagewire._mooncake_shm import SharedSegment
from pagewire._native import _MooncakeTransfers

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "InnerTransferEngine",
    "Read",
    "Write",
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "SUPPORT_INTRA_NVLINK",
    "RpcInterface",
    "CoroRPCInterface",
    "ReceivedData",
    "ReceivedTensor",
    "create_rpc_client",
    "create_rpc_server",
    "SharedSegment",
]

#: This build moves host memory only (no CUDA, HIP, MUSA, EFA or NVLink paths).
SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False


class TransferOpcode:
    """Direction of ``transfer_sync`` / ``batch_transfer_sync``: ``Read`` (0) or
    ``Write`` (1), with the behaviour of Mooncake's pybind11 enum: ``.name``,
    ``.value``, ``int()``, ``__members__``; equal only to the same member (not to the
    int), ordered by value; ``TransferOpcode(v)`` gives a member equal to ``v``'s."""

    __slots__ = ("_value",)
    __members__: "dict[str, TransferOpcode]"
    Read: "TransferOpcode"
    Write: "TransferOpcode"

    def __init__(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                "__init__(): incompatible constructor arguments. The following argument "
                "types are supported:\n    1. TransferOpcode(value: int)"
            )
        self._value = value

    @property
    def value(self) -> int:
        return self._value

    @property
    def name(self) -> str:
        for n, v in type(self).__members__.items():
            if v._value == self._value:
                return n
        return "???"

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._value == self._value  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        return not self == other

    def _cmp(self, other: object, op: str) -> bool:
        if type(other) is not type(self):
            raise TypeError(f"'{op}' not supported between instances of "
                            f"'{type(self).__name__}' and '{type(other).__name__}'")
        return getattr(self._value, op)(other._value)  # type: ignore[attr-defined]

    def __lt__(self, other: object) -> bool:
        return self._cmp(other, "__lt__")

    def __le__(self, other: object) -> bool:
        return self._cmp(other, "__le__")

    def __gt__(self, other: object) -> bool:
        return self._cmp(other, "__gt__")

    def __ge__(self, other: object) -> bool:
        return self._cmp(other, "__ge__")

    def __repr__(self) -> str:
        return f"<TransferOpcode.{self.name}: {self._value}>"

    def __str__(self) -> str:
        return f"TransferOpcode.{self.name}"

    def __reduce__(self) -> Any:
        return (TransferOpcode, (self._value,))


TransferOpcode.Read = TransferOpcode(0)
TransferOpcode.Write = TransferOpcode(1)
TransferOpcode.__members__ = {"Read": TransferOpcode.Read, "Write": TransferOpcode.Write}
TransferOpcode.__doc__ = "Members:\n\n  Read\n\n  Write"


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: ``TransferNotify()`` or ``TransferNotify(name, msg)``.

    Sent with ``transfer_sync(..., notify=...)``; the peer's ``get_notifies()`` returns it
    once, after the batch's data is in its memory.
    """

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferNotify):
            return NotImplemented
        return (self.name, self.msg) == (other.name, other.msg)

    __hash__ = None  # type: ignore[assignment]  # mutable, like Mooncake's


class InnerTransferEngine:
    """The opaque engine handle ``get_engine()`` returns (Mooncake's type name)."""

    __slots__ = ("_owner",)

    def __init__(self, owner: "TransferEngine") -> None:
        self._owner = owner

    def __repr__(self) -> str:
        return f"<InnerTransferEngine of {self._owner.session_id}>"


def _not_implemented(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"pagewire.mooncake_compat.TransferEngine.{name} is not implemented by pagewire "
        "(a CUDA build's call; this build moves host memory only)"
    )


class TransferEngine(_MooncakeTransfers):
    """Mooncake's ``TransferEngine`` on pagewire.

    ``TransferEngine()`` reads ``MC_TRANSFER_TIMEOUT`` (seconds, floor 5, default 30);
    ``initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name)`` starts it:
    verbs when ``protocol == "rdma"`` and an RDMA device opens (the first of the
    comma-separated ``device_name``, or the first usable one), TCP otherwise or with
    ``MC_FORCE_TCP`` set; the choice is logged (logger ``pagewire.mooncake_compat``).
    With ``"etcd://host:port"`` in place of ``"P2PHANDSHAKE"`` the session id is
    ``local_hostname``, published in etcd while the engine lives (docs/python.md,
    "Metadata on etcd").

    Return codes are Mooncake's: 0 success, -1 failure, -3 not registered, -7 overlapping
    registration, 0 as the failed-submission batch id, 1/0/-1/-2 from
    ``transfer_check_status``. pagewire extensions: ``session_id``, ``backend``,
    ``close()``.
    """

    TransferOpcode = TransferOpcode

    def get_notifies(self) -> List[TransferNotify]:
        """Drains the notifications received so far; each is returned once, and only
        after the data of the batch that carried it is in memory."""
        return [TransferNotify(n, m) for n, m in self._get_notifies()]

    def get_engine(self) -> Any:
        """An opaque handle to the underlying engine (``None`` before ``initialize``).
        pagewire has no Mooncake Store, so nothing consumes it yet."""
        if self.session_id is None:
            return None
        return InnerTransferEngine(self)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """EFA only in Mooncake; 0 here, as in Mooncake builds without EFA."""
        return 0

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # CUDA builds only in Mooncake (the non-CUDA wheel has none of these): present for
    # callers that probe with hasattr, and they raise NotImplementedError.

    def transfer_write_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                               length: int, stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Not implemented by pagewire (no CUDA path); raises ``NotImplementedError``."""
        raise _not_implemented("transfer_write_on_cuda")

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Not implemented by pagewire (no CUDA path); raises ``NotImplementedError``."""
        raise _not_implemented("transfer_read_on_cuda")

    def batch_transfer_write_on_cuda(self, target_hostname: str, buffers: List[int],
                                     peer_buffer_addresses: List[int], lengths: List[int],
                                     stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Not implemented by pagewire (no CUDA path); raises ``NotImplementedError``."""
        raise _not_implemented("batch_transfer_write_on_cuda")

    def batch_transfer_read_on_cuda(self, target_hostname: str, buffers: List[int],
                                    peer_buffer_addresses: List[int], lengths: List[int],
                                    stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Not implemented by pagewire (no CUDA path); raises ``NotImplementedError``."""
        raise _not_implemented("batch_transfer_read_on_cuda")


# --- store: mooncake.store.MooncakeDistributedStore on the pagewire store --------------
# (pagewire._mooncake_store has the class and its doctest; the master is pagewire's.)
from pagewire._mooncake_store import (  # noqa: E402
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)

__all__ += ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ObjectDataType"]
# --- end store -------------------------------------------------------------------------
