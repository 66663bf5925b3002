"""The calls of test_store_dummy.py's differential case, on one implementation:
``dummy_diff_cases.py mooncake|pagewire ADDRESS`` runs them as a dummy client of the
standalone client at ADDRESS (``mooncake_client`` or ``pagewire store client``) and prints
one JSON object: case -> result."""

import ctypes
import json
import sys


def main(impl: str, address: str) -> None:
    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator
    else:
        from pagewire.mooncake_store import MooncakeDistributedStore, MooncakeHostMemAllocator
    out = {}
    # Keys of their own: the standalone client may hold other tests' objects.
    P = "diff_"
    s = MooncakeDistributedStore()
    out["setup_dummy"] = s.setup_dummy(64 << 20, 16 << 20, address)
    a = MooncakeHostMemAllocator()
    n = 1 << 20
    p = a.alloc(n)
    out["alloc_nonzero"] = p != 0
    plain = ctypes.create_string_buffer(4096)
    out["register_plain"] = s.register_buffer(ctypes.addressof(plain), 4096)
    out["register_pool"] = s.register_buffer(p, n)
    out["register_inner"] = s.register_buffer(p + 4096, 4096)
    page = 65536
    ctypes.memmove(p, bytes(i % 251 for i in range(page)), page)
    ctypes.memmove(p + page, b"y" * page, page)
    out["batch_put_from"] = s.batch_put_from([P + "k1", P + "k2"], [p, p + page], [page, page])
    out["put_existing"] = s.batch_put_from([P + "k1"], [p + page], [page])
    out["put_small"] = s.put(P + "small", b"hello")
    out["batch_is_exist"] = s.batch_is_exist([P + "k1", P + "small", P + "nope"])
    out["is_exist"] = [s.is_exist(P + "k2"), s.is_exist(P + "nope")]
    out["get"] = [s.get(P + "small").decode(), s.get(P + "nope").decode()]
    out["get_size"] = [s.get_size(P + "k1"), s.get_size(P + "nope")]
    dst = p + 4 * page
    keys = [P + "k1", P + "nope"]
    out["batch_get_into"] = s.batch_get_into(keys, [dst, dst + page], [page, page])
    out["bytes_equal"] = ctypes.string_at(dst, page) == bytes(i % 251 for i in range(page))
    out["get_into"] = s.get_into(P + "k2", dst, page)
    out["get_into_equal"] = ctypes.string_at(dst, page) == b"y" * page
    out["put_from"] = s.put_from(P + "k3", p, 4096)
    out["get_hostname"] = s.get_hostname()
    out["health_check"] = s.health_check()
    out["remove"] = [s.remove(P + "k1", True), s.remove(P + "k1", True)]
    out["unregister"] = s.unregister_buffer(p)
    out["free"] = [a.free(p), a.free(p)]
    out["close"] = s.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
