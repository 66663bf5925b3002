"""pagewire.mooncake_compat.MooncakeDistributedStore on its own: what the differential
test cannot compare (Mooncake crashes or takes 90 s there), and pagewire's own rules."""

import socket
import time

import numpy as np
import pytest

from pagewire.mooncake_compat import (
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)

from store_helpers import Cluster, addr, buffer

MIB = 1 << 20


@pytest.fixture
def master():
    c = Cluster(nodes=0)
    yield c.address
    c.close()


def store(master, segment=16 * MIB):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MIB, "tcp", "", master) == 0
    return s


def test_every_method_before_setup_answers_without_crashing():
    s = MooncakeDistributedStore()
    assert s.is_exist("k") == -1
    assert s.batch_is_exist(["a", "b"]) == [-1, -1]
    assert s.batch_put_from(["a"], [0], [1]) == [-1]
    assert s.batch_get_into(["a"], [0], [1]) == [-1]
    assert s.batch_put_from_multi_buffers(["a"], [[0]], [[1]]) == [-1]
    assert s.batch_get_into_multi_buffers(["a"], [[0]], [[1]]) == [-1]
    assert s.put("k", b"v") == -1 and s.get("k") == b"" and s.get_size("k") == -1
    assert s.register_buffer(1, 1) == -1 and s.unregister_buffer(1) == -1
    assert s.remove("k") == -1 and s.batch_remove(["k"]) == [-1] and s.remove_all() == -1
    assert s.health_check() == 1 and s.get_hostname() == "" and s.close() == 0


def test_unreachable_master_returns_minus_one_within_10_s():
    s = MooncakeDistributedStore()
    t0 = time.monotonic()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", MIB, MIB, "tcp", "", "127.0.0.1:1") == -1
    assert time.monotonic() - t0 < 10
    # A master that never answers: a loopback listener whose accept queue is full drops
    # new connections' SYNs, so the connect (or the Hello) times out, still within 10 s.
    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(0)
        held = []
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(lsn.getsockname())
            held.append(c)
        t0 = time.monotonic()
        master_addr = f"127.0.0.1:{lsn.getsockname()[1]}"
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", MIB, MIB, "tcp", "", master_addr) == -1
        assert time.monotonic() - t0 < 10
        for c in held:
            c.close()


def test_engine_reuse_shares_the_pd_engine_and_its_port(master):
    """SGLang's SGLANG_HICACHE_MOONCAKE_REUSE_TE: the store gets the PD engine's handle and
    the PD engine's session id as local_hostname. It must use that engine (one port, one
    listener) and never try to bind the session id's port."""
    from pagewire.mooncake_compat import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    session = f"127.0.0.1:{te.get_rpc_port()}"
    s = MooncakeDistributedStore()
    rc = s.setup(session, "P2PHANDSHAKE", 8 * MIB, 4 * MIB, "tcp", "", master, te.get_engine())
    assert rc == 0
    assert s.get_hostname() == session, "the store is reachable at the PD engine's port"
    # Another store client reads what this one stored: bytes through the shared engine.
    reader = store(master, segment=0)
    src, dst = buffer(MIB, fill=0x5A), buffer(MIB)
    assert s.register_buffer(src.ctypes.data, MIB) == 0
    assert reader.register_buffer(dst.ctypes.data, MIB) == 0
    assert s.put_from("shared-engine", src.ctypes.data, MIB) == 0
    assert reader.get_into("shared-engine", dst.ctypes.data, MIB) == MIB
    assert (dst == src).all()
    # The PD engine still moves its own bytes after the store closes.
    s.close()
    reader.close()
    other = TransferEngine()
    assert other.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    a, b = buffer(65536, fill=7), buffer(65536)
    assert te.register_memory(a.ctypes.data, 65536) == 0
    assert other.register_memory(b.ctypes.data, 65536) == 0
    peer = f"127.0.0.1:{other.get_rpc_port()}"
    assert te.transfer_sync_write(peer, a.ctypes.data, b.ctypes.data, 65536) == 0
    assert (a == b).all()
    # Anything that is not pagewire's engine handle is refused, not ignored.
    t = MooncakeDistributedStore()
    assert t.setup(session, "P2PHANDSHAKE", MIB, MIB, "tcp", "", master, object()) == -1


def test_a_port_in_local_hostname_is_never_bound(master):
    """Without engine=, the store opens its own engine on the host of local_hostname and
    a port of its own, as Mooncake does: the port named is left alone, even when another
    process listens there."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        s = MooncakeDistributedStore()
        assert s.setup(f"127.0.0.1:{port}", "P2PHANDSHAKE", MIB, MIB, "tcp", "", master) == 0
        host, got = s.get_hostname().rsplit(":", 1)
        assert host == "127.0.0.1" and int(got) != port
        s.close()


def test_setup_forms_and_refusals(master):
    s = MooncakeDistributedStore()
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 4 * MIB,
        "local_buffer_size": 4 * MIB,
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": master,
    }
    assert s.setup(cfg) == 0
    assert s.get_hostname().startswith("localhost:"), "Mooncake's form: the host as given"
    assert s.setup(cfg) == -1, "set up twice"
    assert s.health_check() == 0
    s.close()
    t = MooncakeDistributedStore()
    assert t.setup({**cfg, "bogus": 1}) == -1
    assert t.setup({**cfg, "master_server_addr": "redis://127.0.0.1:6379"}) == -1
    assert t.setup({**cfg, "protocol": "carrier-pigeon"}) == -1
    assert t.setup({**cfg, "enable_ssd_offload": True}) == -1
    with pytest.raises(TypeError):
        t.setup("127.0.0.1", "P2PHANDSHAKE", MIB, MIB, "tcp", "", master, None, bogus=1)
    # "rdma" without a device falls back to TCP (and says so in the log).
    assert t.setup({**cfg, "protocol": "rdma"}) == 0
    assert t.health_check() == 0
    t.close()


def test_replicate_config_fields_and_pins(master):
    c = ReplicateConfig()
    assert (c.replica_num, c.with_hard_pin, c.soft_pin_action) == (1, False, SoftPinAction.PRESERVE)
    assert c.data_type == ObjectDataType.UNKNOWN
    assert not hasattr(c, "session_ids"), "SGLang probes for it with hasattr"
    with pytest.raises(AttributeError):
        c.bogus = 1
    s = store(master)
    mem = buffer(MIB)
    assert s.register_buffer(addr(mem), mem.nbytes) == 0
    c.with_hard_pin = True
    assert s.batch_put_from(["hp"], [addr(mem)], [4096], c) == [0]
    c = ReplicateConfig()
    c.soft_pin_action = SoftPinAction.ENABLE
    c.preferred_segment = s.get_hostname()
    assert s.put_from("sp", addr(mem), 4096, c) == 0
    c.replica_num = 0
    assert s.put_from("r0", addr(mem), 4096, c) == -600
    s.close()


def test_a_full_store_evicts_unleased_objects_for_a_new_put(master):
    """Mooncake answers -200 at once and evicts later; pagewire evicts now (see the
    differential test for Mooncake's side)."""
    s = store(master, segment=8 * MIB)
    mem = buffer(MIB)
    assert s.register_buffer(addr(mem), mem.nbytes) == 0
    for i in range(8):
        assert s.put_from(f"o{i}", addr(mem), MIB) == 0
    assert s.put_from("new", addr(mem), MIB) == 0
    assert s.is_exist("new") == 1
    assert s.is_exist("o0") == 0, "the least recently used went"
    s.close()


def test_copying_calls_larger_than_the_local_buffer(master):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 4096, "tcp", "", master) == 0
    value = np.random.default_rng(3).integers(0, 256, 3 * MIB, dtype=np.uint8).tobytes()
    assert s.put("big", value) == 0
    assert s.get_size("big") == 3 * MIB
    assert s.get("big") == value
    assert s.put("empty", b"") == -600
    assert s.put("big", b"other") == 0 and s.get("big") == value, "first write wins"
    s.close()


def test_store_surface_differences_pagewire_pins(master):
    """What docs/python.md lists as pagewire's own answers for the wheel's other names."""
    import pagewire.mooncake_store as ms

    s = store(master)
    try:
        assert s.create_copy_task("k", [s.get_hostname()]) == ((0, 0), -1012)
        assert s.create_move_task("k", s.get_hostname(), "nowhere:1") == ((0, 0), -600)
        assert s.allocate_and_mount_segment(MIB) == {"ret": -1012, "segment_ids": []}
        # Rust regex syntax on the master: look-around is refused, not misread.
        assert s.put("ka", b"1") == 0 and s.put("kb", b"2") == 0
        assert s.remove_by_regex("k(?=a)") == -600
        assert s.remove_by_regex("^k[ab]$") == 2
        h = s.get_buffer("missing")
        assert h is None
        assert s.put("h", b"held") == 0
        h = s.get_buffer("h")
        assert s.remove("h", True) == 0 and bytes(h) == b"held", "a private copy"
    finally:
        s.close()
    with pytest.raises(NotImplementedError):
        ms.EngramStore(0, ms.EngramStoreConfig())
    assert ms.SoftPinAction.ENABLE == 1 and ms.FAILED is ms.TaskStatus.FAILED


def test_preferred_segment_takes_another_stores_hostname(master):
    """get_hostname() is Mooncake's form (the host as given); a config naming another
    store by it places the replica in that store's segment."""
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    for s in (a, b):
        assert s.setup("localhost", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master) == 0
    try:
        assert a.get_hostname().startswith("localhost:") and a.get_hostname() != b.get_hostname()
        # Several puts each: without the preference, placement takes turns.
        for owner in (a, b, a, b, b, a):
            for i in range(3):
                c = ReplicateConfig()
                c.preferred_segment = owner.get_hostname()
                key = f"to-{owner.get_hostname()}-{i}"
                assert a.upsert(key, b"x" * 4096, c) == 0
                (rep,) = a.get_replica_desc(key)
                where = rep.get_memory_descriptor().buffer_descriptor.transport_endpoint
                assert where.rpartition(":")[2] == owner.get_hostname().rpartition(":")[2]
    finally:
        a.close()
        b.close()
