"""``pagewire.sglang.PagewireStore``: an SGLang HiCache L3 storage backend on the
pagewire store, loaded through SGLang's ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "pagewire", "module_path": "pagewire.sglang",
        "class_name": "PagewireStore", "interface_v1": 1,
        "master_server_address": "10.0.0.1:50051"}'

It implements the zero-copy v1 interface (``batch_exists``, ``batch_set_v1``,
``batch_get_v1``) with the keys of SGLang's Mooncake backend (``{hash}_{tp}_k`` and
``{hash}_{tp}_v`` per page for MHA, ``{hash}__k`` for MLA, ``{hash}_{rank}_k/_v`` per
target rank when heads are split, ``_{pp}`` added with pipeline parallelism). Page
pointers come from pagewire's layout code (:func:`pagewire.sglang.pool_of`), not from
the host pool's ``get_page_buffer_meta``, so every host layout works, including
``head_dim != v_head_dim`` in ``layer_first`` and ``page_head`` and MLA in
``layer_first``. A page's object holds its bytes in the pool's own order: instances
that share a store must use the same host layout (as with SGLang's Mooncake backend).

Options (``extra_config``, else the environment variables SGLang's Mooncake backend
reads): ``master_server_address`` (``MOONCAKE_MASTER``), ``protocol`` (``rdma``: verbs
when a device opens, else TCP; or ``tcp``; ``MOONCAKE_PROTOCOL``), ``device_name``
(``MOONCAKE_DEVICE``), ``global_segment_size`` (bytes, or ``"4gb"``; divided between
the TP x PP ranks as SGLang does; ``MOONCAKE_GLOBAL_SEGMENT_SIZE``), ``local_hostname``
(``MOONCAKE_LOCAL_HOSTNAME``; default: the address that reaches the master),
``replica_num`` (1), ``key_prefix`` (none).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, List, Optional, Tuple

from pagewire._mooncake_store import MooncakeDistributedStore, ReplicateConfig

_log = logging.getLogger("pagewire.sglang")

try:  # SGLang's base class when SGLang is installed: its factory checks issubclass.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # noqa: BLE001  (not installed, or it fails to import without a GPU)

    class _Base:  # type: ignore[no-redef]
        """Stand-in with the parts of SGLang's ``HiCacheStorage`` this backend uses."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def clear(self) -> None:
            pass

        def get_stats(self) -> Any:
            return None


__all__ = ["PagewireStore"]

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def _bytes(v: Any) -> int:
    """An int, or a string such as ``"4gb"`` / ``"512MB"`` (powers of 1024)."""
    if isinstance(v, int):
        return v
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError(f"size {v!r}: expected bytes or a string like '4gb'")
    return int(m.group(1)) << (10 * "bkmgt".index((m.group(2) or "b").lower()))


def _option(extra: dict, key: str, *env: str, default: Any = None) -> Any:
    if extra.get(key) not in (None, ""):
        return extra[key]
    for name in env:
        if os.environ.get(name):
            return os.environ[name]
    return default


class PagewireStore(_Base):
    """SGLang ``HiCacheStorage`` backend on the pagewire store (see the module docstring).

    ``PagewireStore(storage_config, kwargs=None)``, as SGLang's ``dynamic`` factory calls
    it. The host pool arrives with ``register_mem_pool_host``; its buffers are registered
    then.
    """

    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None) -> None:
        cfg = storage_config
        extra = dict(getattr(cfg, "extra_config", None) or {})
        if kwargs:
            extra = {**dict(kwargs), **extra}
        master = _option(extra, "master_server_address", "PAGEWIRE_STORE_MASTER", "MOONCAKE_MASTER")
        if not master:
            raise ValueError(
                "PagewireStore needs the store master: extra_config "
                "'master_server_address' or MOONCAKE_MASTER"
            )
        if not extra.get("interface_v1"):
            _log.warning(
                "PagewireStore: set 'interface_v1': 1 in the extra config; "
                "SGLang uses the zero-copy v1 calls only then"
            )
        self.tp_rank = int(getattr(cfg, "tp_rank", 0) or 0)
        tp_size = int(getattr(cfg, "tp_size", 1) or 1)
        self.pp_rank = int(getattr(cfg, "pp_rank", 0) or 0)
        pp_size = int(getattr(cfg, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(cfg, "is_mla_model", False))
        if pp_size > 1:
            self._mha_suffix = [f"{self.tp_rank}_{self.pp_rank}"]
            self._mla_suffix = f"{self.pp_rank}"
        else:
            self._mha_suffix = [f"{self.tp_rank}"]
            self._mla_suffix = ""
        self.split_factor = 0
        if getattr(cfg, "should_split_heads", False):
            lcm = int(getattr(cfg, "tp_lcm_size", 0) or 0)
            if lcm <= 0 or lcm % tp_size:
                raise ValueError(f"tp_lcm_size {lcm} is not a multiple of tp_size {tp_size}")
            self.split_factor = lcm // tp_size
            base = self.tp_rank * self.split_factor
            ranks = [base + i for i in range(self.split_factor)]
            self._mha_suffix = [
                f"{r}_{self.pp_rank}" if pp_size > 1 else f"{r}" for r in ranks
            ]
        self.key_prefix = extra.get("key_prefix") or None
        self.replica_num = int(extra.get("replica_num", 1))
        segment = _bytes(
            _option(extra, "global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE", default="4gb")
        ) // (tp_size * pp_size)
        protocol = str(_option(extra, "protocol", "MOONCAKE_PROTOCOL", default="rdma"))
        device = str(_option(extra, "device_name", "MOONCAKE_DEVICE", default="") or "")
        hostname = str(
            _option(extra, "local_hostname", "MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME", default="0.0.0.0")
        )
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            hostname, "P2PHANDSHAKE", segment, 16 << 20, protocol, device, str(master)
        )
        if rc != 0:
            raise RuntimeError(f"PagewireStore: store setup failed ({rc}); master {master}")
        self.pool = None
        self.mem_pool_host = None

    # ------------------------------------------------------------------ pools

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Reads the host pool with pagewire's layout code and registers its buffers."""
        super().register_mem_pool_host(mem_pool_host)
        from pagewire.sglang import pool_of

        pool = pool_of(mem_pool_host)
        if self.split_factor and pool.layout != "page_head":
            raise ValueError(
                f"split heads need the page_head layout, not {pool.layout!r}"
            )
        if (pool.geometry.kind == "mla") != self.is_mla:
            raise ValueError(
                f"storage config says is_mla_model={self.is_mla}, the host pool is "
                f"{pool.geometry.kind!r}"
            )
        for addr, length in pool.buffers:
            rc = self.store.register_buffer(addr, length)
            if rc != 0:
                raise RuntimeError(
                    f"PagewireStore: registering host buffer {addr:#x}+{length} failed ({rc})"
                )
        self.pool = pool

    def _tag(self, keys: List[str]) -> List[str]:
        if self.key_prefix is None:
            return list(keys)
        return [f"{self.key_prefix}_{k}" for k in keys]

    def _suffixes(self) -> List[str]:
        if self.is_mla:
            return [f"_{self._mla_suffix}_k"]
        return [f"_{s}_{c}" for s in self._mha_suffix for c in ("k", "v")]

    def _objects(self, keys: List[str], host_indices: Any) -> Tuple[List[str], list, list, int]:
        """Component keys, each one's pointer and size lists, and components per page."""
        if self.pool is None:
            raise RuntimeError("PagewireStore: register_mem_pool_host was not called")
        pool = self.pool
        suffixes = self._suffixes()
        names = [k + s for k in self._tag(keys) for s in suffixes]
        per_page = len(suffixes)
        if self.split_factor:
            ptrs, sizes = pool.split_heads_meta(host_indices, self.split_factor, as_lists=True)
        else:
            ptrs, sizes = pool.page_meta(host_indices, as_lists=True)
        if len(ptrs) != len(keys) * pool.entries_per_page * (self.split_factor or 1):
            raise ValueError(
                f"{len(keys)} keys for {len(ptrs) // max(pool.entries_per_page, 1)} pages"
            )
        if len(ptrs) == len(names):
            return names, [[p] for p in ptrs], [[s] for s in sizes], per_page
        # layer_first: each page's entries run layer by layer, one per component in each
        # layer, so component c's parts are every per_page-th entry from c.
        e = pool.entries_per_page
        all_ptrs, all_sizes = [], []
        for page in range(len(keys)):
            base = page * e
            for c in range(per_page):
                all_ptrs.append(ptrs[base + c : base + e : per_page])
                all_sizes.append(sizes[base + c : base + e : per_page])
        return names, all_ptrs, all_sizes, per_page

    def _config(self) -> ReplicateConfig:
        c = ReplicateConfig()
        c.replica_num = self.replica_num
        return c

    @staticmethod
    def _pages(results: List[int], per_page: int, ok) -> List[bool]:
        return [
            all(ok(r) for r in results[i : i + per_page])
            for i in range(0, len(results), per_page)
        ]

    # ------------------------------------------------------------------ v1 interface

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many leading pages have every component in the store."""
        if not keys:
            return 0
        names = [k + s for k in self._tag(keys) for s in self._suffixes()]
        per_page = len(self._suffixes())
        ex = self.store.batch_is_exist(names)
        for i in range(len(keys)):
            if not all(r == 1 for r in ex[i * per_page : (i + 1) * per_page]):
                return i
        return len(keys)

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Writes each page's components from the host pool (those not stored yet)."""
        if not keys:
            return []
        names, ptrs, sizes, per_page = self._objects(list(keys), host_indices)
        exist = self.store.batch_is_exist(names)
        results = [0 if e == 1 else -1 for e in exist]
        todo = [i for i, e in enumerate(exist) if e != 1]
        if todo:
            put = self.store.batch_put_from_multi_buffers(
                [names[i] for i in todo],
                [ptrs[i] for i in todo],
                [sizes[i] for i in todo],
                self._config(),
            )
            for i, r in zip(todo, put):
                results[i] = r
        return self._pages(results, per_page, lambda r: r == 0)

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads each page's components into the host pool."""
        if not keys:
            return []
        names, ptrs, sizes, per_page = self._objects(list(keys), host_indices)
        got = self.store.batch_get_into_multi_buffers(names, ptrs, sizes)
        return self._pages(got, per_page, lambda r: r > 0)

    # ------------------------------------------------------------------ the rest

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Zero-copy only: ``target_location``/``target_sizes`` are an address and a size
        (or lists of them) in a registered host buffer."""
        if target_location is None or target_sizes is None:
            raise ValueError("PagewireStore.set is zero-copy only: pass target_location and target_sizes")
        ptrs = list(target_location) if isinstance(target_location, (list, tuple)) else [target_location]
        sizes = list(target_sizes) if isinstance(target_sizes, (list, tuple)) else [target_sizes]
        if self.store.is_exist(key) == 1:
            return True
        return self.store.batch_put_from_multi_buffers([key], [ptrs], [sizes], self._config())[0] == 0

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if target_locations is None or target_sizes is None:
            raise ValueError("PagewireStore.batch_set is zero-copy only")
        return all(self.set(k, None, p, s) for k, p, s in zip(keys, target_locations, target_sizes))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Zero-copy only: reads into ``target_location``; returns it, or ``None``."""
        if target_location is None or target_sizes is None:
            raise ValueError("PagewireStore.get is zero-copy only: pass target_location and target_sizes")
        ptrs = list(target_location) if isinstance(target_location, (list, tuple)) else [target_location]
        sizes = list(target_sizes) if isinstance(target_sizes, (list, tuple)) else [target_sizes]
        r = self.store.batch_get_into_multi_buffers([key], [ptrs], [sizes])[0]
        return target_location if r > 0 else None

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        if target_locations is None or target_sizes is None:
            raise ValueError("PagewireStore.batch_get is zero-copy only")
        return [self.get(k, p, s) for k, p, s in zip(keys, target_locations, target_sizes)]

    def clear(self) -> None:
        """Removes every object not under a read lease (SGLang's Mooncake backend does the
        same)."""
        self.store.remove_all()

    def get_stats(self) -> Any:
        return None

    def close(self) -> None:
        self.store.close()
