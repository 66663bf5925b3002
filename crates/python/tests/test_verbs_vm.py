"""The compat engine over RDMA verbs, between two processes, in the soft-RoCE VM.

On the host (no RDMA device) this module is skipped, visibly. In the VM
(`scripts/rdma-vm.sh run -- ...`, which sets RDMA_DEVICE=rxe0 and RDMA_REQUIRED=1) it
runs for real, and a missing device is a failure:

    scripts/rdma-vm.sh --cpus 2 run -- sh -c 'cd crates/python/tests && \
        ../../../.venv/bin/python -m pytest -q -p no:cacheprovider test_verbs_vm.py'
"""

import ctypes
import hashlib
import os
import threading
import time

import pytest

from pagewire.mooncake_compat import TransferEngine, TransferNotify, TransferOpcode
from peer_proc import PeerProcess, pattern

DEVICE = os.environ.get("RDMA_DEVICE")
REQUIRED = os.environ.get("RDMA_REQUIRED") == "1"

if not DEVICE and not REQUIRED:
    pytest.skip(
        "RDMA_DEVICE not set: the verbs tests run in the soft-RoCE VM (scripts/test.sh)",
        allow_module_level=True,
    )

MB = 1 << 20


@pytest.fixture
def engine(monkeypatch):
    for v in ("MC_FORCE_TCP", "PAGEWIRE_TRANSPORT"):
        monkeypatch.delenv(v, raising=False)
    assert DEVICE, "RDMA_REQUIRED=1 but RDMA_DEVICE is not set"
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", DEVICE) == 0
    assert te.backend == "verbs", f"protocol rdma on {DEVICE} did not open verbs (backend {te.backend})"
    yield te
    te.close()


def test_pages_between_two_processes_over_verbs(engine):
    # Small sizes: the guest runs under TCG, where Python itself is slow.
    a = engine
    size, page = MB, 16 << 10
    data = pattern(11, size)
    src = ctypes.create_string_buffer(data, size)
    sa = ctypes.addressof(src)
    assert a.register_memory(sa, size) == 0
    with PeerProcess("pagewire", "rdma", size, env={"RDMA_DEVICE": DEVICE}) as b:
        assert b.backend == "verbs"
        # 32 pages, scattered on the receiver as a PD transfer's runs are
        dst_pages = [(i * 13) % 32 for i in range(32)]
        srcs = [sa + i * page for i in range(32)]
        dsts = [b.addr + p * page for p in dst_pages]
        assert a.batch_transfer_sync_write(b.sid, srcs, dsts, [page] * 32) == 0
        for i in (0, 1, 17, 31):
            want = hashlib.sha256(data[i * page : (i + 1) * page]).hexdigest()
            assert b.digest(dst_pages[i] * page, page) == want, f"page {i}"
        # a notification arrives once, and only after its data
        half = size // 2
        new = pattern(12, half // 2)
        ctypes.memmove(sa, new, len(new))
        result = {}
        t = threading.Thread(target=lambda: result.update(b.cmd("waitnote", 60, half, len(new))))
        t.start()
        time.sleep(0.05)
        note = TransferNotify("prefill", "req-1 done")
        assert a.batch_transfer_sync(b.sid, [sa], [b.addr + half], [len(new)], TransferOpcode.Write, note) == 0
        t.join(90)
        assert result["notifies"] == [["prefill", "req-1 done"]]
        assert result["sha256"] == hashlib.sha256(new).hexdigest()
        assert b.cmd("notifies")["notifies"] == []
        # READ back from the other process
        b.cmd("fill", 13)
        assert a.transfer_sync_read(b.sid, sa + half, b.addr + 8192, 32768) == 0
        assert ctypes.string_at(sa + half, 32768) == pattern(13, size)[8192 : 8192 + 32768]
        # a refused batch writes nothing on the other side
        before = b.digest(0, b.len)
        rc = a.batch_transfer_sync_write(b.sid, [sa, sa], [b.addr, b.addr + b.len - 8], [4096, 4096])
        assert rc == -1
        loose = ctypes.create_string_buffer(4096)
        assert a.transfer_sync_write(b.sid, ctypes.addressof(loose), b.addr, 4096) == -1
        assert b.digest(0, b.len) == before
