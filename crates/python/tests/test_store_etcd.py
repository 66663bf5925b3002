"""The store on masters elected through a real etcd (Debian's etcd-server, started here on
127.0.0.1 ports of its own): ``StoreMaster(ha=...)`` campaigns, and
``MooncakeDistributedStore.setup(..., master_server_addr="etcd://...")`` follows the
leader, also after it shuts down. Fails (never skips) without the ``etcd`` binary."""

import os
import time

import pytest

from pagewire import StoreMaster
from pagewire.mooncake_compat import MooncakeDistributedStore

from etcd_helpers import etcd_server

MIB = 1 << 20


@pytest.fixture
def etcd():
    with etcd_server() as (url, _, _):
        yield url


def one_leader(masters, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leading = [m for m in masters if m.leading]
        if len(leading) == 1:
            return leading[0]
        time.sleep(0.02)
    raise AssertionError(f"no single leader within {timeout} s")


def test_mooncake_store_follows_the_leader_through_etcd(etcd):
    masters = [
        StoreMaster("127.0.0.1:0", ha=etcd, cluster_id="py", ha_lease=2.0, heartbeat=0.2)
        for _ in range(2)
    ]
    os.environ["PAGEWIRE_STORE_CLUSTER_ID"] = "py"
    try:
        leader = one_leader(masters)
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", etcd) == 0
        assert s.put("before", b"x" * 4096) == 0
        assert s.get("before") == b"x" * 4096

        # The leader leaves (it resigns: no lease to wait out); the other leads, the
        # store's segment is mounted again there, and puts go on. The new leader replayed
        # the op-log: what the old one published is still there, with its bytes.
        leader.shutdown()
        t = time.monotonic()
        one_leader([m for m in masters if m is not leader])
        while s.put("after", b"y" * 4096) != 0:
            assert time.monotonic() - t < 15, "no put served after the leader left"
            time.sleep(0.1)
        assert s.get("after") == b"y" * 4096
        assert s.get("before") == b"x" * 4096
        s.close()
    finally:
        del os.environ["PAGEWIRE_STORE_CLUSTER_ID"]
        for m in masters:
            m.shutdown()
