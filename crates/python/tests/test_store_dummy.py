"""``setup_dummy``: a master and a standalone client (``pagewire store master``, ``pagewire
store client``) as processes, and two dummy client processes that put (one) and read back
byte-exact (the other) through ``MooncakeDistributedStore.setup_dummy`` and
``MooncakeHostMemAllocator``; the standalone client's token guards it. The differential
case runs the same calls against Mooncake's own ``mooncake_master`` and ``mooncake_client``
(the mooncake-transfer-engine-non-cuda wheel; fails, never skips, without it)."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagewire.mooncake_store import MooncakeDistributedStore, MooncakeHostMemAllocator

HERE = Path(__file__).resolve().parent
TOKEN = "dummy-test-token"


def pagewire_bin() -> str:
    """The CLI binary (scripts/python-test.sh builds it and sets PAGEWIRE_BIN)."""
    path = os.environ.get("PAGEWIRE_BIN") or str(HERE.parents[2] / "target" / "debug" / "pagewire")
    assert Path(path).is_file(), f"{path} missing: build it with `cargo build -p pagewire-cli`"
    return path


def spawn(args, env):
    p = subprocess.Popen(
        [pagewire_bin(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(f"pagewire {args} did not start: {p.stderr.read()}")
    return p, line


@pytest.fixture(scope="module")
def standalone():
    env = dict(os.environ, PAGEWIRE_TOKEN=TOKEN)
    procs = []
    try:
        m, line = spawn(["store", "master", "--listen", "127.0.0.1:0"], env)
        procs.append(m)
        master = next(w for w in line.split() if w.startswith("127.0.0.1:"))
        address = f"127.0.0.1:{random.randint(20000, 60000)}"
        c, line = spawn(
            ["store", "client", "--master", master, "--segment", "128M", "--listen",
             "127.0.0.1:0", "--transport", "tcp", "--address", address],
            env,
        )  # fmt: skip
        procs.append(c)
        assert line.startswith("pagewire store client: 128.0 MiB segment"), line
        assert "dummy clients at @pagewire_client_" in line, line
        yield address, env
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def run_dummy(mode, address, env):
    r = subprocess.run(
        [sys.executable, str(HERE / "dummy_proc.py"), mode, address],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_dummy_processes_put_and_get_byte_exact(standalone):
    address, env = standalone
    run_dummy("put", address, env)
    run_dummy("get", address, env)


def test_dummy_needs_the_token_and_a_live_client(standalone, monkeypatch):
    address, _ = standalone
    monkeypatch.setenv("PAGEWIRE_TOKEN", "wrong")
    assert MooncakeDistributedStore().setup_dummy(1 << 20, 1 << 20, address) == -1
    monkeypatch.delenv("PAGEWIRE_TOKEN")
    assert MooncakeDistributedStore().setup_dummy(1 << 20, 1 << 20, address) == -1
    monkeypatch.setenv("PAGEWIRE_TOKEN", TOKEN)
    assert MooncakeDistributedStore().setup_dummy(1 << 20, 1 << 20, "127.0.0.1:1") == -1
    assert MooncakeDistributedStore().setup_dummy(1 << 20, 1 << 20, "no-port") == -1
    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 20, 1 << 20, address) == 0
    assert s.setup_dummy(1 << 20, 1 << 20, address) == -1  # already set up
    assert s.health_check() == 0
    s.close()


def test_dummy_has_the_full_clients_calls(standalone, monkeypatch):
    """The calls built on the store's native client (copying, upserts, pattern removal)
    work on a dummy too, through the standalone client."""
    address, _ = standalone
    monkeypatch.setenv("PAGEWIRE_TOKEN", TOKEN)
    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 20, 1 << 20, address) == 0
    try:
        keys = [f"full-{i}" for i in range(3)]
        values = [bytes([i + 1]) * (1000 + i) for i in range(3)]
        assert s.put_batch(keys, values) == 0
        assert s.get_batch(keys + ["full-missing"]) == values + [b""]
        assert s.upsert(keys[0], b"new bytes") == 0
        assert s.get(keys[0]) == b"new bytes"
        # The reads above hold leases: a forced removal, as on a full client.
        assert s.remove_by_regex("^full-[12]$") == 0
        assert s.remove_by_regex("^full-[12]$", force=True) == 2
        assert s.remove_by_regex("(unclosed") == -600
        assert s.batch_is_exist(keys) == [1, 0, 0]
        assert s.remove(keys[0], force=True) == 0
    finally:
        s.close()


def test_host_mem_allocator():
    a = MooncakeHostMemAllocator()
    p = a.alloc(1 << 20)
    assert p != 0 and p % 4096 == 0
    assert a.free(p) == 0
    assert a.free(p) == -1
    assert a.alloc(0) == 0


# case -> (SAME, value) or (DIFFERS, mooncake, pagewire, why)
SAME, DIFFERS = "same", "differs"
EXPECT = {
    "setup_dummy": (SAME, 0),
    "alloc_nonzero": (SAME, True),
    "register_plain": (SAME, -1),
    "register_pool": (SAME, 0),
    "register_inner": (
        DIFFERS, -1, 0,
        "pagewire accepts any range inside a shared buffer (it is registered already)",
    ),  # fmt: skip
    "batch_put_from": (SAME, [0, 0]),
    "put_existing": (SAME, [0]),
    "put_small": (SAME, 0),
    "batch_is_exist": (SAME, [1, 1, 0]),
    "is_exist": (SAME, [1, 0]),
    "get": (SAME, ["hello", ""]),
    "get_size": (SAME, [65536, -704]),
    "batch_get_into": (SAME, [65536, -704]),
    "bytes_equal": (SAME, True),
    "get_into": (SAME, 65536),
    "get_into_equal": (SAME, True),
    "put_from": (SAME, 0),
    "get_hostname": (SAME, ""),
    "health_check": (SAME, 0),
    "remove": (SAME, [0, -704]),
    "unregister": (SAME, 0),
    "free": (SAME, [0, -1]),
    "close": (SAME, 0),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases(impl, address, env):
    r = subprocess.run(
        [sys.executable, str(HERE / "dummy_diff_cases.py"), impl, address],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, f"{impl}: {r.stdout[-2000:]}{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mooncake_client(tmp_path_factory):
    try:
        import mooncake
    except ImportError as e:
        pytest.fail(f"the Mooncake wheel is missing (scripts/python-test.sh installs it): {e}")
    mdir = Path(mooncake.__file__).parent
    env = dict(os.environ, LD_LIBRARY_PATH=str(mdir))
    log = tmp_path_factory.mktemp("mooncake")
    rpc, http, port = free_port(), free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen(
            [str(mdir / "mooncake_master"), f"--rpc_port={rpc}",
             "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(log / "master.log", "w"),
        ))  # fmt: skip
        time.sleep(1)
        client_log = log / "client.log"
        procs.append(subprocess.Popen(
            [str(mdir / "mooncake_client"), f"--master_server_address=127.0.0.1:{rpc}",
             f"--metadata_server=http://127.0.0.1:{http}/metadata", f"--port={port}",
             "--host=127.0.0.1", "--global_segment_size=64MB", "--protocol=tcp"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(client_log, "w"),
        ))  # fmt: skip
        deadline = time.time() + 30
        while "Starting real client service" not in client_log.read_text():
            assert time.time() < deadline, client_log.read_text()[-3000:]
            assert procs[-1].poll() is None, client_log.read_text()[-3000:]
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def test_setup_dummy_against_mooncake_client(standalone, mooncake_client):
    address, env = standalone
    pw = cases("pagewire", address, env)
    mc = cases("mooncake", mooncake_client, dict(os.environ))
    rows = ["| case | kind | Mooncake | pagewire |", "| --- | --- | --- | --- |"]
    for case, exp in EXPECT.items():
        rows.append(f"| {case} | {exp[0]} | `{mc.get(case)}` | `{pw.get(case)}` |")
    out = HERE.parents[2] / "target" / "store-dummy-diff.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(rows) + "\n")
    assert set(mc) == set(pw) == set(EXPECT)
    for case, exp in EXPECT.items():
        if exp[0] == SAME:
            assert mc[case] == exp[1], f"{case}: Mooncake changed: {mc[case]!r}"
            assert pw[case] == exp[1], f"{case}: pagewire differs from Mooncake: {pw[case]!r}"
        else:
            _, want_mc, want_pw, why = exp
            assert mc[case] == want_mc, f"{case}: Mooncake changed: {mc[case]!r}"
            assert pw[case] == want_pw, f"{case}: pagewire changed ({why}): {pw[case]!r}"
