"""The store on masters elected through a real etcd (Debian's etcd-server, started here on
127.0.0.1 ports of its own): ``StoreMaster(ha=...)`` campaigns, and
``MooncakeDistributedStore.setup(..., master_server_addr="etcd://...")`` follows the
leader, also after it shuts down, and routes keys over the shards of a sharded cluster
(``pagewire store master --shards 2 --shard i`` processes). Fails (never skips) without
the ``etcd`` binary."""

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from pagewire import StoreMaster
from pagewire.mooncake_compat import MooncakeDistributedStore

from etcd_helpers import enable_auth, etcd_keys, etcd_server, make_certs

MIB = 1 << 20


@pytest.fixture
def etcd():
    with etcd_server() as (url, _, _):
        yield url


def pagewire_bin() -> str:
    """The CLI binary (scripts/python-test.sh builds it and sets PAGEWIRE_BIN)."""
    here = Path(__file__).resolve().parent
    path = os.environ.get("PAGEWIRE_BIN") or str(here.parents[2] / "target" / "debug" / "pagewire")
    assert Path(path).is_file(), f"{path} missing: build it with `cargo build -p pagewire-cli`"
    return path


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


def test_mooncake_store_routes_keys_over_two_shards():
    with etcd_server() as (url, port, _):
        masters = []
        try:
            for shard in (0, 1):
                p = subprocess.Popen(
                    [pagewire_bin(), "store", "master", "--listen", "127.0.0.1:0", "--ha", url,
                     "--cluster-id", "pysh", "--ha-lease-s", "2", "--heartbeat-ms", "200",
                     "--shards", "2", "--shard", str(shard)],
                    stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                masters.append(p)
                assert f"shard {shard} of 2" in p.stdout.readline()
            os.environ["PAGEWIRE_STORE_CLUSTER_ID"] = "pysh"
            s = MooncakeDistributedStore()
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", url) == 0
            keys = [f"page-{i}" for i in range(32)]
            values = [bytes([i]) * 4096 for i in range(32)]
            for k, v in zip(keys, values):
                assert s.put(k, v) == 0
            # Both shards' leaders logged publications: the keys landed on both.
            for shard in (0, 1):
                logged = etcd_keys(port, f"pagewire-store/pysh/shard/{shard}/oplog/")
                assert logged, f"nothing published on shard {shard}"
            assert etcd_keys(port, "pagewire-store/pysh/shards") == {
                "pagewire-store/pysh/shards": b"2"
            }
            assert [s.get(k) for k in keys] == values
            mixed = [keys[3], "missing-a", keys[17], "missing-b"]
            assert s.batch_is_exist(mixed) == [1, 0, 1, 0]
            assert s.remove(keys[5], True) == 0  # leased by the get: forced
            assert s.is_exist(keys[5]) == 0
            assert s.remove_all(True) == 31
            assert s.batch_is_exist(keys[:4]) == [0, 0, 0, 0]
            s.close()
        finally:
            os.environ.pop("PAGEWIRE_STORE_CLUSTER_ID", None)
            for p in masters:
                p.kill()
                p.wait()


@contextlib.contextmanager
def store_through_env(argv, env: dict, cluster: str, url: str, monkeypatch):
    """A master process started with ``env`` added to its environment; then, with ``env``
    in this process's environment too, a ``MooncakeDistributedStore`` set up against it
    (yielded, after a put and get checked) and a ``TransferEngine`` that publishes its
    name in the same etcd."""
    from pagewire.mooncake_compat import TransferEngine

    master = subprocess.Popen(argv, env=dict(os.environ, **env), stdout=subprocess.PIPE, text=True)
    try:
        assert "campaigning through" in master.stdout.readline()
        monkeypatch.setenv("PAGEWIRE_STORE_CLUSTER_ID", cluster)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = MooncakeDistributedStore()
        t = time.monotonic()
        while s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", url) != 0:
            assert time.monotonic() - t < 10, "no leader served setup"
            time.sleep(0.1)
        value = cluster.encode() * 512
        assert s.put("k", value) == 0
        assert s.get("k") == value
        te = TransferEngine()
        assert te.initialize(f"engine-{cluster}", url, "tcp", "") == 0
        te.close()
        yield s
        s.close()
    finally:
        master.kill()
        master.wait()


def test_store_and_engine_on_an_etcd_with_authentication(monkeypatch):
    """etcd with authentication on: a master process, this process's store client and its
    transfer engine take etcd's user from PAGEWIRE_ETCD_USER / PAGEWIRE_ETCD_PASSWORD and
    work; a wrong password stops a master at start (the password never printed), fails
    ``setup`` with a non-zero code and ``initialize`` with -1, quickly."""
    from pagewire.mooncake_compat import TransferEngine

    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with etcd_server() as (url, port, _):
        enable_auth(port, {"kv": ("s3cret", ["pagewire-store/", "pagewire/te/"])})
        good = {"PAGEWIRE_ETCD_USER": "kv", "PAGEWIRE_ETCD_PASSWORD": "s3cret"}
        argv = [pagewire_bin(), "store", "master", "--listen", "127.0.0.1:0", "--ha", url,
                "--cluster-id", "pyauth", "--ha-lease-s", "2", "--heartbeat-ms", "200"]  # fmt: skip
        t = time.monotonic()
        wrong = dict(os.environ, **good) | {"PAGEWIRE_ETCD_PASSWORD": "hunter2"}
        bad = subprocess.run(argv, env=wrong, capture_output=True, text=True, timeout=20)
        assert bad.returncode != 0 and "refused access" in bad.stderr, bad.stderr
        assert "hunter2" not in bad.stderr + bad.stdout
        assert time.monotonic() - t < 5
        with store_through_env(argv, good, "pyauth", url, monkeypatch) as s:
            monkeypatch.setenv("PAGEWIRE_ETCD_PASSWORD", "hunter2")
            t = time.monotonic()
            other = MooncakeDistributedStore()
            assert other.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", url) != 0
            assert TransferEngine().initialize("prefill-bad", url, "tcp", "") == -1
            assert time.monotonic() - t < 5
            assert s.get("k") == b"pyauth" * 512  # the client already set up is unaffected


def test_store_and_engine_on_etcd_over_tls(monkeypatch, tmp_path):
    """etcd serving clients over TLS with client certificates: PAGEWIRE_ETCD_CA,
    PAGEWIRE_ETCD_CERT and PAGEWIRE_ETCD_KEY in the environment let a master process,
    ``MooncakeDistributedStore`` and ``TransferEngine`` in; without them, or with a
    certificate but no key, they stay out (non-zero, -1)."""
    from pagewire.mooncake_compat import TransferEngine

    certs = make_certs(str(tmp_path))
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with etcd_server(tls=certs) as (url, _, _):
        tls = {"PAGEWIRE_ETCD_CA": certs["ca"], "PAGEWIRE_ETCD_CERT": certs["client_cert"],
               "PAGEWIRE_ETCD_KEY": certs["client_key"]}  # fmt: skip
        # Plain TCP to the TLS port: nothing, within the set-up's time.
        t = time.monotonic()
        assert TransferEngine().initialize("plain", url, "tcp", "") == -1
        assert time.monotonic() - t < 15
        argv = [pagewire_bin(), "store", "master", "--listen", "127.0.0.1:0", "--ha", url,
                "--cluster-id", "pytls", "--ha-lease-s", "2", "--heartbeat-ms", "200"]  # fmt: skip
        with store_through_env(argv, tls, "pytls", url, monkeypatch):
            monkeypatch.delenv("PAGEWIRE_ETCD_KEY")
            assert TransferEngine().initialize("half", url, "tcp", "") == -1


def test_in_process_masters_of_two_shards():
    """``StoreMaster(ha=..., shards=2, shard=i)``: a leader group per shard in this
    process; a client routes keys over both (each shard's op-log has entries), and a
    master given another shard count, or shards without ``ha``, is refused."""
    with etcd_server() as (url, port, _):
        masters = [
            StoreMaster("127.0.0.1:0", ha=url, cluster_id="pyin", ha_lease=2.0, heartbeat=0.2,
                        shards=2, shard=i)
            for i in (0, 1)
        ]  # fmt: skip
        try:
            with pytest.raises(Exception, match="shard"):
                StoreMaster("127.0.0.1:0", ha=url, cluster_id="pyin", shards=3, shard=0)
            with pytest.raises(ValueError, match="need ha"):
                StoreMaster("127.0.0.1:0", shards=2, shard=1)
            for m in masters:
                one_leader([m])
            os.environ["PAGEWIRE_STORE_CLUSTER_ID"] = "pyin"
            s = MooncakeDistributedStore()
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", url) == 0
            keys = [f"in-{i}" for i in range(24)]
            for i, k in enumerate(keys):
                assert s.put(k, bytes([i]) * 2048) == 0
            for shard in (0, 1):
                assert etcd_keys(port, f"pagewire-store/pyin/shard/{shard}/oplog/"), shard
            assert [s.get(k) for k in keys] == [bytes([i]) * 2048 for i in range(24)]
            s.close()
        finally:
            os.environ.pop("PAGEWIRE_STORE_CLUSTER_ID", None)
            for m in masters:
                m.shutdown()
