"""The native store API (pagewire.StoreClient, pagewire.StoreMaster): a master in this
process, a storage node process, clients here; TCP on 127.0.0.1."""

import time

import numpy as np
import pytest

import pagewire
from pagewire import StoreClient, StoreError

from store_helpers import Cluster, addr, buffer


@pytest.fixture
def cluster():
    c = Cluster(nodes=2, segment=16 << 20)
    yield c
    c.close()


def client(c, **kw):
    return StoreClient(c.address, listen="127.0.0.1:0", transport="tcp", **kw)


def test_round_trip_with_replicas_on_two_nodes(cluster):
    a, b = client(cluster), client(cluster)
    n, size = 32, 16 << 10
    src = buffer(n * size)
    src[:] = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
    dst = buffer(n * size + 64)
    a.register_buffer(addr(src), src.nbytes)
    b.register_buffer(addr(dst), dst.nbytes)
    keys = [f"p{i}" for i in range(n)]
    # Each object in two parts.
    ptrs = [[addr(src) + i * size, addr(src) + i * size + 100] for i in range(n)]
    sizes = [[100, size - 100] for _ in range(n)]
    assert a.put(keys, ptrs, sizes, replicas=2) == [0] * n
    got = b.get(keys, [[addr(dst) + i * size] for i in range(n)], [[size] for _ in range(n)])
    assert got == [size] * n
    assert np.array_equal(dst[: n * size], src)
    assert not dst[n * size :].any()
    for size_, replicas in b.query(keys):
        assert size_ == size
        assert len({ep for _, ep, _ in replicas}) == 2
        assert {ep for _, ep, _ in replicas} == {n.endpoint for n in cluster.nodes}
    assert b.exist(keys + ["missing"]) == [1] * n + [0]
    st = cluster.master.stats()
    assert st["objects"] == n and st["segments"] == 2
    assert a.stats()["objects"] == n


def test_codes_per_key(cluster):
    a = client(cluster)
    src = buffer(8192)
    a.register_buffer(addr(src), src.nbytes)
    assert a.put(["k"], [[addr(src)]], [[4096]]) == [0]
    assert a.put(["k"], [[addr(src)]], [[4096]]) == [-705]
    assert a.put([b"bytes-key"], [[addr(src)]], [[10]]) == [0]
    stray = np.zeros(64, dtype=np.uint8)
    assert a.put(["u"], [[addr(stray)]], [[64]]) == [-600], "unregistered source"
    assert a.put([""], [[addr(src)]], [[1]]) == [-400]
    assert a.get(["k"], [[addr(src)]], [[4095]]) == [-600], "buffer too small"
    assert a.get(["none"], [[addr(src)]], [[4096]]) == [-704]
    assert a.get(["k", "k"], [[addr(src)], [addr(src) + 4096]], [[4096], [4096]]) == [4096, 4096]
    assert a.remove(["k"]) == [-706], "read lease"
    assert a.remove(["k"], force=True) == [0]
    assert a.remove(["k"]) == [-704]
    assert a.remove_all() == 1
    with pytest.raises(ValueError):
        a.put(["a"], [[1, 2]], [[1]])
    with pytest.raises(TypeError):
        a.exist([1])
    with pytest.raises(StoreError) as e:
        a.register_buffer(0, 4096)
    assert e.value.code == -600
    with pytest.raises(StoreError):
        a.register_buffer(addr(src), src.nbytes)  # twice
    a.unregister_buffer(addr(src))
    with pytest.raises(StoreError):
        a.unregister_buffer(addr(src))


def test_a_client_segment_is_used_and_unmounted_on_close(cluster):
    own = client(cluster, segment_size=8 << 20)
    assert own.segment is not None and own.segment[1] == 8 << 20
    assert cluster.master.stats()["segments"] == 3
    src = buffer(4096, fill=7)
    own.register_buffer(addr(src), 4096)
    assert own.put(["mine"], [[addr(src)]], [[4096]], preferred=own.endpoint) == [0]
    [(size, reps)] = own.query(["mine"])
    assert reps[0][1] == own.endpoint
    reader = client(cluster)
    dst = buffer(4096)
    reader.register_buffer(addr(dst), 4096)
    assert reader.get(["mine"], [[addr(dst)]], [[4096]]) == [4096]
    assert (dst == 7).all()
    own.close()
    assert own.closed
    with pytest.raises(RuntimeError):
        own.exist(["mine"])
    deadline = time.monotonic() + 5
    while cluster.master.stats()["segments"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert reader.exist(["mine"]) == [0], "its only replica went with the segment"


def test_unreachable_master_fails_within_the_connect_timeout():
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        StoreClient("127.0.0.1:1", listen="127.0.0.1:0", transport="tcp", connect_timeout=2.0)
    assert time.monotonic() - t0 < 3
    assert e.value.code == -900
    assert isinstance(e.value, pagewire.PagewireError)


def test_master_gone_gives_a_typed_error_within_the_deadline():
    c = Cluster(nodes=1, segment=4 << 20)
    try:
        a = client(c, timeout=2.0)
        src = buffer(4096)
        a.register_buffer(addr(src), 4096)
        c.master.shutdown()
        t0 = time.monotonic()
        with pytest.raises(StoreError) as e:
            a.put(["x"], [[addr(src)]], [[4096]])
        assert time.monotonic() - t0 < 3
        assert e.value.code in (-900, -901)
        assert not a.ping(0.5)
    finally:
        c.close()
