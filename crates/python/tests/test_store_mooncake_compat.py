"""pagewire.mooncake_compat.MooncakeDistributedStore on its own: what the differential
test cannot compare (Mooncake crashes or takes 90 s there), and pagewire's own rules."""

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
    # An address that drops packets: the connect times out instead (10.255.255.1 is not
    # routed here), still within 10 s.
    t0 = time.monotonic()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", MIB, MIB, "tcp", "", "10.255.255.1:50051") == -1
    assert time.monotonic() - t0 < 10


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
    assert s.get_hostname().startswith("127.0.0.1:")
    assert s.setup(cfg) == -1, "set up twice"
    assert s.health_check() == 0
    s.close()
    t = MooncakeDistributedStore()
    assert t.setup({**cfg, "bogus": 1}) == -1
    assert t.setup({**cfg, "master_server_addr": "etcd://127.0.0.1:2379"}) == -1
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
