"""A dummy client process for test_store_dummy.py: ``dummy_proc.py put|get ADDRESS`` sets
up ``MooncakeDistributedStore.setup_dummy`` against a standalone client and writes (put)
or reads back and checks (get) the objects below; prints ``OK`` or raises."""

import ctypes
import sys

from pagewire.mooncake_store import MooncakeDistributedStore, MooncakeHostMemAllocator

PAGE = 64 << 10
KEYS = [f"h{i}_0_k" for i in range(16)]


def pattern(key: str, n: int) -> bytes:
    seed = sum(key.encode()) * 131
    return bytes((seed + i * 7) & 0xFF for i in range(n))


def main(mode: str, address: str) -> None:
    store = MooncakeDistributedStore()
    assert store.setup_dummy(256 << 20, 16 << 20, address) == 0
    alloc = MooncakeHostMemAllocator()
    pool = alloc.alloc(len(KEYS) * PAGE)
    assert pool != 0
    # Registering memory that is not shared is refused; the pool is accepted.
    plain = ctypes.create_string_buffer(4096)
    assert store.register_buffer(ctypes.addressof(plain), 4096) == -1
    assert store.register_buffer(pool, len(KEYS) * PAGE) == 0
    ptrs = [pool + i * PAGE for i in range(len(KEYS))]
    if mode == "put":
        for k, p in zip(KEYS, ptrs):
            ctypes.memmove(p, pattern(k, PAGE), PAGE)
        assert store.batch_put_from(KEYS, ptrs, [PAGE] * len(KEYS)) == [0] * len(KEYS)
        assert store.put("small", b"hello dummy") == 0
        # Larger than the 16 MiB local buffer: staged through a temporary shared buffer.
        assert store.put("big", pattern("big", 20 << 20)) == 0
    else:
        assert store.batch_is_exist(KEYS + ["nope"]) == [1] * len(KEYS) + [0]
        assert store.get("small") == b"hello dummy"
        assert store.get("big") == pattern("big", 20 << 20)
        assert store.get("nope") == b""
        assert store.get_size(KEYS[0]) == PAGE
        got = store.batch_get_into(KEYS, ptrs, [PAGE] * len(KEYS))
        assert got == [PAGE] * len(KEYS), got
        for k, p in zip(KEYS, ptrs):
            assert ctypes.string_at(p, PAGE) == pattern(k, PAGE), k
        assert store.get_into(KEYS[0], pool, 100) == -600
        assert store.remove(KEYS[0], force=True) == 0
        assert store.is_exist(KEYS[0]) == 0
        assert store.health_check() == 0
        assert store.get_hostname() == ""
    assert store.unregister_buffer(pool) == 0
    assert alloc.free(pool) == 0
    assert alloc.free(pool) == -1
    assert store.close() == 0
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
