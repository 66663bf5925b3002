"""The transfer engine with an etcd metadata server, for test_mooncake_etcd.py's
differential test: ``python etcd_cases.py IMPL URL`` (``IMPL``: ``pagewire`` or
``mooncake``) runs the calls below in one process and prints one JSON object of what
each returned; ``unreachable`` in place of ``URL`` runs ``initialize`` against an etcd
address where nobody listens, alone in its process. The caller sets
``MC_TCP_BIND_ADDRESS=127.0.0.1`` so that both implementations stay on 127.0.0.1."""

import gc
import json
import sys
import time

from etcd_helpers import etcd_keys
from peer_proc import Buf, pattern
from store_diff_cases import free_port

N = 64 << 10


def run(impl: str, url: str) -> dict:
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
        prefix = "mooncake/"
    else:
        from pagewire.mooncake_compat import TransferEngine
        prefix = "pagewire/te/"
    port = int(url.rsplit(":", 1)[1])
    out = {}
    a, b = TransferEngine(), TransferEngine()
    out["init"] = [a.initialize("etcd-a", url, "tcp", ""), b.initialize("etcd-b", url, "tcp", "")]
    out["keys"] = sorted(etcd_keys(port, prefix))
    src, pool, back = Buf(N, seed=5), Buf(4 * N), Buf(N)
    out["register"] = [a.register_memory(src.addr, N), b.register_memory(pool.addr, 4 * N),
                       a.register_memory(back.addr, N)]  # fmt: skip
    out["write_by_name"] = a.transfer_sync_write("etcd-b", src.addr, pool.addr + N, N)
    out["landed"] = pool.bytes(N, N) == pattern(5, N)
    out["read_by_name"] = a.transfer_sync_read("etcd-b", back.addr, pool.addr + N, N)
    out["read_back"] = back.bytes() == pattern(5, N)
    out["write_own_name"] = a.transfer_sync_write("etcd-a", src.addr, back.addr, N)
    out["write_unknown"] = a.transfer_sync_write("etcd-nobody", src.addr, pool.addr, N)
    out["read_unknown"] = a.transfer_sync_read("etcd-nobody", back.addr, pool.addr, N)
    out["first_buffer_unknown"] = a.get_first_buffer_address("etcd-nobody")
    out["first_buffer_known"] = a.get_first_buffer_address("etcd-b") == pool.addr
    dup = TransferEngine()
    out["init_same_name"] = dup.initialize("etcd-b", url, "tcp", "")
    del dup
    gc.collect()
    out["keys_after_same_name"] = sorted(etcd_keys(port, prefix))
    # b goes away: its name leaves etcd.
    if hasattr(b, "close"):
        b.close()
    del b
    gc.collect()
    out["keys_after_close"] = sorted(etcd_keys(port, prefix))
    return out


def unreachable(impl: str) -> dict:
    """In a process of its own: Mooncake's etcd client is one per process, connected by
    the first engine (a later engine's etcd address is ignored)."""
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from pagewire.mooncake_compat import TransferEngine
    url = f"etcd://127.0.0.1:{free_port()}"
    t = time.monotonic()
    rc = TransferEngine().initialize("etcd-x", url, "tcp", "")
    return {"init_unreachable": rc, "init_unreachable_s": round(time.monotonic() - t, 1)}


if __name__ == "__main__":
    if sys.argv[2] == "unreachable":
        print(json.dumps(unreachable(sys.argv[1])), flush=True)
    else:
        print(json.dumps(run(sys.argv[1], sys.argv[2])), flush=True)
