"""Mooncake Store's Python surface (``mooncake.store.MooncakeDistributedStore``) on the
pagewire store: the methods SGLang's HiCache and vLLM call, with Mooncake's names,
arguments and return codes. Imported through :mod:`pagewire.mooncake_compat`.

>>> from pagewire.mooncake_compat import MooncakeDistributedStore, ReplicateConfig
>>> store = MooncakeDistributedStore()
>>> store.is_exist("k")            # before setup: -1, not a crash
-1
>>> ReplicateConfig().replica_num
1

The master is pagewire's (``pagewire store master``, or :class:`pagewire.StoreMaster`),
not ``mooncake_master``: the API is compatible, the wire is not. Where Mooncake is lax
pagewire is strict, and says so in the method's docstring: an unregistered source or
destination buffer is ``-600`` (nothing is read or written), a method called before
``setup`` returns ``-1``, and an unreachable master makes ``setup`` return ``-1`` within
10 s (Mooncake: about 90 s).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import mmap
import operator
import random
import socket
import threading
from typing import Any, List, Optional, Sequence

from pagewire._mooncake_store_more import _StoreMore
from pagewire._mooncake_store_types import parse_size
from pagewire._native import DummyClient, StoreClient, StoreError, shm_alloc, shm_free

__all__ = [
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ReplicateConfig",
    "SoftPinAction",
    "ObjectDataType",
]

_log = logging.getLogger("pagewire.mooncake_compat")

# Mooncake Store's ErrorCode values that these methods return.
_OK = 0
_INTERNAL_ERROR = -1
_INVALID_PARAMS = -600
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705

#: Deadline for reaching the master in ``setup`` (seconds).
SETUP_TIMEOUT = 5.0


class SoftPinAction(enum.IntEnum):
    """What a put does to the soft pin (Mooncake's values)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's object type tag (accepted and ignored)."""

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
    """How a put places its objects, with Mooncake's field names and defaults.

    ``replica_num`` replicas on distinct segments (best effort), ``with_hard_pin`` (never
    evicted), ``soft_pin_action = SoftPinAction.ENABLE`` (evicted last),
    ``preferred_segment``/``preferred_segments`` (a client's ``get_hostname()``: its
    segment takes the first replica when it has room). ``soft_pin_ttl_ms``,
    ``group_ids`` and ``data_type`` are accepted and not used; ``prefer_alloc_in_same_node``
    makes the batch puts return ``-600``, as Mooncake's do. Fields Mooncake's class does not
    have are absent, so ``hasattr`` probes answer as they would for Mooncake's.
    """

    __slots__ = (
        "replica_num",
        "nof_replica_num",
        "dfs_replica_num",
        "with_hard_pin",
        "soft_pin_action",
        "_soft_pin_ttl_ms",
        "preferred_segment",
        "preferred_segments",
        "preferred_nof_segments",
        "prefer_alloc_in_same_node",
        "group_ids",
        "data_type",
    )

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.with_hard_pin = False
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None
        self.preferred_segment = ""
        self.preferred_segments: List[str] = []
        self.preferred_nof_segments: List[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids = None
        self.data_type = ObjectDataType.UNKNOWN

    @property
    def soft_pin_ttl_ms(self) -> Optional[int]:
        """How long a soft pin lasts (ms), ``None`` for the master's default; an unsigned
        integer, so ``-1`` raises ``TypeError`` as Mooncake's does. Accepted, not used."""
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: Optional[int]) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64
        ):
            raise TypeError(f"soft_pin_ttl_ms: an unsigned 64-bit integer or None, not {value!r}")
        self._soft_pin_ttl_ms = value

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, "
            f"with_hard_pin={self.with_hard_pin}, soft_pin_action={self.soft_pin_action!r}, "
            f"preferred_segment={self.preferred_segment!r})"
        )


def _put_options(config: Optional[ReplicateConfig]) -> Optional[dict]:
    """``put`` keyword arguments for a config, or ``None`` when Mooncake refuses it."""
    if config is None:
        config = ReplicateConfig()
    if getattr(config, "prefer_alloc_in_same_node", False):
        return None
    try:
        replicas = int(config.replica_num)
    except (TypeError, ValueError):
        return None
    if not 1 <= replicas <= 16:
        return None
    if config.with_hard_pin:
        pin = "hard"
    elif int(getattr(config, "soft_pin_action", 0)) == SoftPinAction.ENABLE:
        pin = "soft"
    else:
        pin = "none"
    preferred = config.preferred_segment or (
        config.preferred_segments[0] if config.preferred_segments else None
    )
    return {"replicas": replicas, "pin": pin, "preferred": preferred or None}


def _multi(keys: Sequence[Any], all_buffer_ptrs: Any, all_sizes: Any) -> tuple:
    """The multi-buffer calls' arguments as lists; ``(keys, None, None)`` when their
    lengths disagree (one list per key, one size per pointer)."""
    keys = list(keys)
    ptrs = [list(p) for p in all_buffer_ptrs]
    sizes = [list(s) for s in all_sizes]
    if not (len(keys) == len(ptrs) == len(sizes)) or any(
        len(p) != len(s) for p, s in zip(ptrs, sizes)
    ):
        return keys, None, None
    return keys, ptrs, sizes


#: The ports Mooncake's store picks its RPC port from (``get_hostname()``'s port).
PORT_RANGE = (12300, 14300)


def _host_of(local_hostname: str) -> tuple:
    """``(host as given, IP to listen on)`` for ``local_hostname`` (``host`` or
    ``host:port``). The port a ``local_hostname`` carries is not bound: it may be another
    engine's (SGLang passes its PD engine's session id), and Mooncake's store picks its
    own too."""
    host = local_hostname
    if local_hostname.startswith("["):
        host = local_hostname[1:].partition("]")[0]
    elif local_hostname.count(":") == 1:
        host = local_hostname.split(":")[0]
    if not host:
        return "", "0.0.0.0"
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        _log.warning("local_hostname %r does not resolve; listening on 0.0.0.0", host)
        ip = "0.0.0.0"
    return host, ip


@functools.lru_cache(maxsize=256)
def _resolved(name: str) -> str:
    """``host:port`` with the host resolved to its IPv4 address (unchanged when it does not
    resolve or has no port)."""
    host, sep, port = name.rpartition(":")
    if not sep or not host or host.startswith("["):
        return name
    try:
        return f"{socket.gethostbyname(host)}:{port}"
    except OSError:
        return name


def _free_port(ip: str) -> int:
    """A port of :data:`PORT_RANGE` free on ``ip`` now (random tries), else ``0``."""
    for _ in range(32):
        port = random.randrange(*PORT_RANGE)
        with socket.socket() as probe:
            try:
                probe.bind((ip, port))
            except OSError:
                continue
        return port
    return 0


class _Staging:
    """A registered buffer for the copying calls (``put``, ``get``): private memory for a
    client of its own, shared memory (:func:`shm_alloc`) for a dummy client, which its
    standalone client reads and writes directly."""

    def __init__(self, client: Any, size: int) -> None:
        self.size = max(int(size), 4096)
        self.client = client
        self.shm = isinstance(client, DummyClient)
        if self.shm:
            self.addr = shm_alloc(self.size)
            # Another process writes these pages: copied in and out, never kept as views.
            self.mem = memoryview((ctypes.c_char * self.size).from_address(self.addr)).cast("B")
        else:
            self.mem = mmap.mmap(-1, self.size)
            self.view = (ctypes.c_char * self.size).from_buffer(self.mem)
            self.addr = ctypes.addressof(self.view)
        try:
            client.register_buffer(self.addr, self.size)
        except BaseException:
            self._free()
            raise

    def read(self, n: int) -> bytes:
        """The first ``n`` bytes, copied."""
        return bytes(self.mem[:n]) if self.shm else self.mem[:n]

    def _free(self) -> None:
        if self.shm:
            self.mem.release()
            shm_free(self.addr)
        else:
            del self.view
            self.mem.close()

    def close(self) -> None:
        try:
            self.client.unregister_buffer(self.addr)
        except Exception:  # closed client: its registrations are gone already
            pass
        self._free()


class MooncakeHostMemAllocator:
    """Mooncake's allocator for host pools that a dummy client
    (:meth:`MooncakeDistributedStore.setup_dummy`) shares with its standalone client:
    ``alloc(size)`` returns the address of ``size`` zeroed bytes of shared memory (``0`` on
    failure), ``free(ptr)`` releases it (``0``, or ``-1`` for an address it did not hand
    out). SGLang's ``MooncakeHostTensorAllocator`` wraps it for ``standalone_storage``."""

    def alloc(self, arg0: int, /) -> int:
        try:
            return shm_alloc(int(arg0))
        except (StoreError, OverflowError, ValueError) as e:
            _log.error("MooncakeHostMemAllocator.alloc(%s): %s", arg0, e)
            return 0

    def free(self, arg0: int, /) -> int:
        return _OK if shm_free(int(arg0)) else _INTERNAL_ERROR


class MooncakeDistributedStore(_StoreMore):
    """``mooncake.store.MooncakeDistributedStore`` on pagewire (see the module docstring).

    Return codes are Mooncake's: ``0`` or a size on success; ``-200`` no space, ``-600``
    invalid arguments, ``-704`` not found, ``-706`` leased, ``-800`` transfer failed,
    ``-900`` master unavailable, ``-901`` timeout, ``-1`` before ``setup``.
    """

    def __init__(self) -> None:
        self._client: Optional[StoreClient] = None
        self._hostname = ""
        self._staging: Optional[_Staging] = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up

    def setup(
        self,
        local_hostname: Any,
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Joins the store: ``0``, or ``-1`` (logged) when the master cannot be reached
        within 5 s or an argument is refused. ``setup(config_dict)`` takes Mooncake's dict
        form. ``protocol``: ``"rdma"`` uses verbs when a device opens, else TCP (logged);
        ``"tcp"`` uses TCP. ``global_segment_size`` bytes of this process are offered to
        the store. ``metadata_server`` is not needed (any value is accepted), and SSD
        offload is not supported (``enable_ssd_offload=True`` returns ``-1``).
        ``engine``: the handle ``TransferEngine.get_engine()`` returns (SGLang passes its
        PD engine's with ``SGLANG_HICACHE_MOONCAKE_REUSE_TE``): the store then uses that
        engine, its port, backend and token, and opens none of its own (``protocol``
        and ``rdma_devices`` are the engine's); another engine object returns ``-1``.
        Without it the store opens its own engine on ``local_hostname``'s host and a
        port of its own: a port in ``local_hostname`` is never bound (Mooncake does not
        either).
        Mooncake's config has no token: ``PAGEWIRE_TOKEN`` in the environment guards the
        master link, the engine and the segment alike.
        """
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            known = {
                "local_hostname", "metadata_server", "global_segment_size",
                "local_buffer_size", "protocol", "rdma_devices", "master_server_addr",
                "ipc_socket_path", "enable_ssd_offload", "ssd_offload_path", "tenant_id",
                "enable_client_http_server", "client_http_port",
            }  # fmt: skip
            unknown = set(cfg) - known
            if unknown or "local_hostname" not in cfg:
                _log.error("setup: unknown keys %s or no local_hostname", sorted(unknown))
                return _INTERNAL_ERROR
            cfg.pop("ipc_socket_path", None)
            for key in ("global_segment_size", "local_buffer_size"):
                if key in cfg:
                    size = parse_size(cfg[key])
                    if size is None:
                        _log.error("setup: %s %r is not a size", key, cfg[key])
                        return _INVALID_PARAMS
                    cfg[key] = size
            return self.setup(**cfg)
        # Mooncake's positional form takes integers only (size strings go in the dict):
        # anything else is the same TypeError.
        global_segment_size = operator.index(global_segment_size)
        local_buffer_size = operator.index(local_buffer_size)
        if self._client is not None:
            _log.error("setup: already set up")
            return _INTERNAL_ERROR
        if enable_ssd_offload:
            _log.error("setup: SSD offload is not supported by pagewire's store")
            return _INTERNAL_ERROR
        if "://" in str(master_server_addr) and not str(master_server_addr).startswith("etcd://"):
            _log.error(
                "setup: master %r: pagewire's store takes host:port or etcd://h:p;h:p",
                master_server_addr,
            )
            return _INTERNAL_ERROR
        proto = str(protocol).lower()
        if proto not in ("tcp", "rdma"):
            _log.error("setup: protocol %r is neither tcp nor rdma", protocol)
            return _INTERNAL_ERROR
        device = str(rdma_devices or "").split(",")[0].strip() or None
        shared = None
        if engine is not None:
            from pagewire.mooncake_compat import InnerTransferEngine

            if not isinstance(engine, InnerTransferEngine):
                _log.error(
                    "setup: engine %r is not a pagewire engine handle (TransferEngine.get_engine())",
                    type(engine).__name__,
                )
                return _INTERNAL_ERROR
            shared = engine._owner
        host = ""
        try:
            if shared is not None:
                client = StoreClient.sharing(
                    str(master_server_addr),
                    shared,
                    segment_size=int(global_segment_size),
                    connect_timeout=SETUP_TIMEOUT,
                )
            else:
                host, ip = _host_of(str(local_hostname))
                client = StoreClient(
                    str(master_server_addr),
                    listen=f"{ip}:{_free_port(ip)}",
                    transport="auto" if proto == "rdma" else "tcp",
                    device=device if proto == "rdma" else None,
                    segment_size=int(global_segment_size),
                    connect_timeout=SETUP_TIMEOUT,
                )
        except (StoreError, ValueError, OverflowError) as e:
            _log.error("setup: %s", e)
            return _INTERNAL_ERROR
        if shared is None and proto == "rdma" and client.transport != "verbs":
            _log.warning("setup: protocol 'rdma' but no RDMA device opened: using TCP")
        try:
            staging = _Staging(client, local_buffer_size)
        except (StoreError, OSError, ValueError) as e:
            _log.error("setup: local buffer of %s bytes: %s", local_buffer_size, e)
            client.close()
            return _INTERNAL_ERROR
        self._client, self._staging = client, staging
        # Mooncake names a store by the host it was given and its own port.
        port = client.endpoint.rpartition(":")[2]
        self._hostname = f"{host}:{port}" if shared is None and host else client.endpoint
        return _OK

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Joins the store through a standalone client of this host (``pagewire store
        client``, Mooncake's ``mooncake_client``) instead of opening a segment and an engine:
        ``0``, or ``-1`` (logged) when it cannot be reached or refuses. ``server_address``
        is Mooncake's ``host:port`` (the standalone client's ``--address``; it stands for
        the abstract socket ``@pagewire_client_<port>.sock``), or ``@name`` /
        ``unix:/path``. Buffers given to ``register_buffer`` must come from
        :class:`MooncakeHostMemAllocator` (or :meth:`alloc_from_mem_pool`): shared memory
        the standalone client maps, so puts and gets move no byte through the socket;
        other memory gives ``-600``. ``local_buffer_size`` bytes of shared memory back
        ``put``/``get``. ``mem_pool_size`` is accepted and not reserved up front: pools are
        mapped when registered. ``PAGEWIRE_TOKEN`` must be the standalone client's token."""
        if self._client is not None:
            _log.error("setup_dummy: already set up")
            return _INTERNAL_ERROR
        try:
            if int(mem_pool_size) < 0 or int(local_buffer_size) < 0:
                raise ValueError("negative size")
            client = DummyClient(str(server_address))
        except (StoreError, ValueError, OverflowError, TypeError) as e:
            _log.error("setup_dummy: %s", e)
            return _INTERNAL_ERROR
        try:
            staging = _Staging(client, local_buffer_size)
        except (StoreError, OSError, ValueError) as e:
            _log.error("setup_dummy: local buffer of %s bytes: %s", local_buffer_size, e)
            client.close()
            return _INTERNAL_ERROR
        self._client, self._staging = client, staging
        return _OK

    def alloc_from_mem_pool(self, arg0: int, /) -> int:
        """Shared memory for a dummy client's buffers (as
        :meth:`MooncakeHostMemAllocator.alloc`): its address, or ``0`` (also on a store
        that is not a dummy, which has no pool, as Mooncake's)."""
        if not isinstance(self._client, DummyClient):
            return 0
        return MooncakeHostMemAllocator().alloc(arg0)

    def get_hostname(self) -> str:
        """The store's name, as Mooncake's: ``local_hostname``'s host and the store's own
        port (one of :data:`PORT_RANGE` when free), e.g. ``localhost:12345``; with
        ``engine=``, the engine's session id. ``""`` before ``setup``. Configs'
        ``preferred_segment`` and ``batch_replica_clear`` take it."""
        return self._hostname if self._client is not None else ""

    def _endpoint_of(self, segment: Optional[str]) -> Optional[str]:
        """The transport endpoint for a segment name: a store's ``get_hostname()`` is its
        host as given and its endpoint's port, so the host is resolved."""
        if not segment:
            return segment
        if self._client is not None and segment == self._hostname:
            return self._client.endpoint
        return _resolved(segment)

    def health_check(self) -> int:
        """``0`` healthy, ``1`` not set up or closed, ``2`` master unreachable."""
        if self._client is None:
            return 1
        return 0 if self._client.ping(2.0) else 2

    def close(self) -> int:
        """Leaves the store (the master unmounts this client's segment); ``0``."""
        client, self._client = self._client, None
        for name in ("_region_map", "_put_sessions", "_get_sessions"):
            self.__dict__.pop(name, None)
        if client is not None:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            client.close()
        return _OK

    # ------------------------------------------------------------------ buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """``0``; ``-600`` for size 0, memory not mapped read-write, or a buffer registered
        twice. After :meth:`setup_dummy`: memory from :class:`MooncakeHostMemAllocator`
        only, else ``-1`` (as Mooncake's dummy)."""
        if self._client is None:
            return _INTERNAL_ERROR
        try:
            self._client.register_buffer(int(buffer_ptr), int(size))
        except (StoreError, OverflowError, ValueError) as e:
            _log.debug("register_buffer: %s", e)
            return self._refused()
        self._note_registered(buffer_ptr, size)
        return _OK

    def _refused(self) -> int:
        """A refused (un)registration: ``-1`` on a dummy client (memory that is not shared,
        as Mooncake's dummy answers), ``-600`` otherwise."""
        return _INTERNAL_ERROR if isinstance(self._client, DummyClient) else _INVALID_PARAMS

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """``0``; ``-600`` for a buffer not registered."""
        if self._client is None:
            return _INTERNAL_ERROR
        try:
            self._client.unregister_buffer(int(buffer_ptr))
        except (StoreError, OverflowError, ValueError):
            return self._refused()
        self._note_unregistered(buffer_ptr)
        return _OK

    # ------------------------------------------------------------------ existence

    def is_exist(self, key: str) -> int:
        """``1``, ``0``, or a negative code."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        """Per key ``1``, ``0`` or a negative code; ``[]`` for ``[]``."""
        keys = list(keys)
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        if not keys:
            return []
        try:
            return self._client.exist(keys)
        except StoreError as e:
            return [e.code] * len(keys)

    def get_size(self, key: str) -> int:
        """The object's size, or ``-704``."""
        if self._client is None:
            return _INTERNAL_ERROR
        try:
            r = self._client.query([key])[0]
        except StoreError as e:
            return e.code
        return r[0] if isinstance(r, tuple) else r

    # ------------------------------------------------------------------ zero-copy puts

    def _put(self, keys: List[Any], ptrs: List[List[int]], sizes: List[List[int]], config) -> List[int]:
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        if not keys:
            return []
        opts = _put_options(config)
        if opts is None:
            return [_INVALID_PARAMS] * len(keys)
        opts["preferred"] = self._endpoint_of(opts["preferred"])
        try:
            codes = self._client.put(keys, ptrs, sizes, **opts)
        except StoreError as e:
            return [e.code] * len(keys)
        except (ValueError, TypeError, OverflowError) as e:
            _log.debug("put: %s", e)
            return [_INVALID_PARAMS] * len(keys)
        # An existing key keeps its first value and the put counts as done (Mooncake).
        return [_OK if c == _OBJECT_ALREADY_EXISTS else c for c in codes]

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        """``0`` or a negative code; the source must be registered (else ``-600``; Mooncake
        accepts an unregistered source over TCP)."""
        return self._put([key], [[buffer_ptr]], [[size]], config)[0]

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Per key ``0`` (an existing key keeps its first value and also gives ``0``) or a
        negative code: ``-600`` for lists of unequal length (every key), size 0 or an
        unregistered source; ``-200`` when there is no room even after eviction."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [_INVALID_PARAMS] * len(keys)
        return self._put(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes], config)

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Like :meth:`batch_put_from`; each object is the concatenation of its buffers."""
        keys, all_buffer_ptrs, all_sizes = _multi(keys, all_buffer_ptrs, all_sizes)
        if all_buffer_ptrs is None:
            return [_INVALID_PARAMS] * len(keys)
        return self._put(keys, all_buffer_ptrs, all_sizes, config)

    # ------------------------------------------------------------------ zero-copy gets

    def _get(self, keys: List[Any], ptrs: List[List[int]], sizes: List[List[int]]) -> List[int]:
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        if not keys:
            return []
        try:
            return self._client.get(keys, ptrs, sizes)
        except StoreError as e:
            return [e.code] * len(keys)
        except (ValueError, TypeError, OverflowError) as e:
            _log.debug("get: %s", e)
            return [_INVALID_PARAMS] * len(keys)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, or a negative code."""
        return self._get([key], [[buffer_ptr]], [[size]])[0]

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> List[int]:
        """Per key the object's size, ``-704`` missing, ``-600`` buffer smaller than the
        object or not registered (a larger one is fine); lists of unequal length: every
        key ``-600``."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [_INVALID_PARAMS] * len(keys)
        return self._get(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes])

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> List[int]:
        """Per key the object's size (filled into its buffers in order), or a negative
        code."""
        keys, all_buffer_ptrs, all_sizes = _multi(keys, all_buffer_ptrs, all_sizes)
        if all_buffer_ptrs is None:
            return [_INVALID_PARAMS] * len(keys)
        return self._get(keys, all_buffer_ptrs, all_sizes)

    # ------------------------------------------------------------------ copying calls

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Stores a bytes-like ``value`` (copied through the local buffer): ``0`` or a
        negative code; an existing key keeps its first value and gives ``0``."""
        if self._client is None:
            return _INTERNAL_ERROR
        data = memoryview(value).cast("B")
        n = len(data)
        if n == 0:
            return _INVALID_PARAMS
        with self._lock:
            st = self._staging
            tmp = None
            if n > st.size:
                tmp = _Staging(self._client, n)
                st = tmp
            try:
                st.mem[:n] = data
                return self._put([key], [[st.addr]], [[n]], config)[0]
            finally:
                if tmp is not None:
                    tmp.close()

    def get(self, key: str) -> bytes:
        """The object's bytes, or ``b""`` when it is missing (or the read failed)."""
        if self._client is None:
            return b""
        size = self.get_size(key)
        if size <= 0:
            return b""
        with self._lock:
            st = self._staging
            tmp = None
            if size > st.size:
                tmp = _Staging(self._client, size)
                st = tmp
            try:
                r = self._get([key], [[st.addr]], [[size]])[0]
                return st.read(r) if r > 0 else b""
            finally:
                if tmp is not None:
                    tmp.close()

    # ------------------------------------------------------------------ removal

    def remove(self, key: str, force: bool = False) -> int:
        """``0``, ``-704`` missing, ``-706`` under a read lease (unless ``force``)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> List[int]:
        """Per key as :meth:`remove`."""
        keys = list(keys)
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        if not keys:
            return []
        try:
            return self._client.remove(keys, bool(force))
        except StoreError as e:
            return [e.code] * len(keys)

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed (leased ones stay unless ``force``), or a
        negative code."""
        if self._client is None:
            return _INTERNAL_ERROR
        try:
            return self._client.remove_all(bool(force))
        except StoreError as e:
            return e.code

    def __repr__(self) -> str:
        return f"MooncakeDistributedStore(endpoint={self.get_hostname()!r})"
