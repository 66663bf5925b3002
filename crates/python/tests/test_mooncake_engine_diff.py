"""Differential test of the rest of ``mooncake.engine``: managed buffers and the byte
helpers, ``RpcInterface`` between two processes, ``SharedSegment`` between two processes,
``TransferOpcode``'s enum behaviour; the same calls on the Mooncake wheel
(mooncake-transfer-engine-non-cuda 0.3.13.post1) and on pagewire.mooncake_compat
(engine_surface_cases.py, one process per implementation), compared.

SAME: both give the pinned value. STRICT: Mooncake is lax or broken and pagewire refuses
or works; both values are pinned (docs/python.md lists each). Also: every public name of
the wheel's ``mooncake.engine`` exists in pagewire with the same parameters.

If the Mooncake wheel is missing this fails; it never skips.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, MC_TRANSFER_TIMEOUT="5")
for _v in ("MC_FORCE_TCP", "PAGEWIRE_TRANSPORT", "PAGEWIRE_AS_MOONCAKE", "PAGEWIRE_TOKEN"):
    ENV.pop(_v, None)

SAME = "same"
STRICT = "strict"

# 8 KiB blocks are carved top-down from the end of a 2 GiB chunk (Mooncake's buddy
# allocator): offsets from the chunk, which get_first_buffer_address names.
GIB2 = 2 << 30
MANAGED_OFFSETS = [GIB2 - 8192, GIB2 - 2 * 8192, GIB2 - 4 * 8192, GIB2 - 5 * 8192]


def received(cb, n, sha, **extra):
    if cb == "data":
        return {"cb": "data", "type": "dict", "keys": ["data", "source"], "source": "",
                "data": {"len": n, "sha": sha}}
    return {"cb": "tensor", "type": "ReceivedTensor", "source": "", "size": n,
            "bytes": {"len": n, "sha": sha}, "view": {"len": n, "sha": sha}, **extra}


EXPECT = {
    # --- managed buffers and byte helpers
    "managed_offsets": (SAME, {"nonzero": True, "offsets": MANAGED_OFFSETS}),
    "write_read_bytes": (SAME, {
        "rc": [0, 0, 0, 0, 0],
        # "hello", b"HEL\0LO", bytearray b"xy", "é" as UTF-8, 2 bytes of "abc"
        "bytes": "68656c6c6f00000048454c004c4f00007879000000000000c3a90000000000006162000000000000",
    }),
    "read_zero_length": (SAME, {"rc": "b''"}),
    "write_bytes_none": (SAME, {"rc": 0}),
    "write_bytes_bad_type": (SAME, {"rc": "TypeError"}),
    "allocate_negative": (SAME, {"rc": "TypeError"}),
    "managed_free_and_reuse": (SAME, {"rc": [0, 0], "reuses_last_freed": True}),
    "managed_large": (SAME, {"nonzero": True, "free": 0}),
    "managed_is_registered": (SAME, {"rc": 0, "bytes": {"len": 4096, "sha": "f302957da5220938"}}),
    # Mooncake copies to and from any address; pagewire only inside registered memory.
    "write_bytes_unregistered": (STRICT, {"rc": 0, "written": True}, {"rc": -1, "written": False}),
    "read_bytes_unregistered": (STRICT, {"rc": "bytes"}, {"rc": "ValueError"}),
    # Mooncake puts any address on its free list (a later allocation hands it out).
    "free_unknown_address": (STRICT, {"rc": 0}, {"rc": -1}),
    # --- TransferOpcode: pybind11 enum behaviour
    "opcode_basics": (SAME, {"rc": ["Read", 0, "Write", 1, 1, "<TransferOpcode.Read: 0>",
                                    "TransferOpcode.Write", 0, ["Read", "Write"], True, True]}),
    "opcode_equality": (SAME, {"rc": [False, True, False, True, True, False, True, 1, "Read"]}),
    "opcode_errors": (SAME, {"rc": ["TypeError", "TypeError", "TypeError",
                                    "<TransferOpcode.???: 5>"]}),
    # --- RpcInterface, client and server in two processes
    "rpc_server_start_twice": (SAME, {"rc": [True, False]}),
    "rpc_send_small": (SAME, {"rc": 0, "received": received("data", 11, "b206899bc103669c")}),
    "rpc_send_empty": (SAME, {"rc": 0, "received": received("data", 0, "e3b0c44298fc1c14")}),
    "rpc_send_2mib": (SAME, {"rc": 0, "received": received("data", 2 << 20, "91d3beb88a9b2f77")}),
    # >= 72 bytes starting like a tensor header go to the tensor callback; Mooncake's
    # ReceivedTensor.shape cannot be read (pybind11 cannot convert its vector).
    "rpc_send_tensor_header": (
        STRICT,
        {"rc": 0, "received": received("tensor", 76, "1aa8605003757d43", dtype="float32",
                                       total_bytes=0, shape="TypeError")},
        {"rc": 0, "received": received("tensor", 76, "1aa8605003757d43", dtype="float32",
                                       total_bytes=0, shape=[3, 4])},
    ),
    "rpc_callback_raises": (SAME, {"rc": 0}),
    # send_tensor sends the tensor's bytes only (no shape, no dtype).
    "rpc_send_tensor_duck": (SAME, {"rc": 0, "received": received("data", 24, "d824b19e660d0ef3")}),
    "rpc_send_str": (SAME, {"rc": "TypeError"}),
    "rpc_send_bytearray": (SAME, {"rc": "TypeError"}),
    "rpc_send_tensor_not_a_tensor": (SAME, {"rc": -1}),
    "rpc_send_tensor_async_not_a_tensor": (SAME, {"rc": "AttributeError"}),
    "rpc_send_no_listener": (SAME, {"rc": -1}),
    "rpc_send_bad_address": (SAME, {"rc": -1}),
    # Mooncake's send_data_async raises (pybind11's GIL check fails); pagewire's works.
    "rpc_send_data_async": (
        STRICT,
        {"rc": "RuntimeError"},
        {"rc": 0, "received": received("data", 5, "2d4a6334d2f2bb73")},
    ),
    "rpc_start_errors": (SAME, {"rc": [False, True, False, False, False, True, "TypeError"]}),
    "rpc_types": (SAME, {"rc": [True, "RpcInterface", "RpcInterface", "TypeError", "TypeError"]}),
    # --- SharedSegment, owner and peer in two processes
    "shm_supported": (SAME, {"rc": [True, False, False, False]}),
    "shm_before_complete": (SAME, {"rc": [False, True, 8192, 0, False, 8192]}),
    # Mooncake reserves the peer's address range in create; pagewire maps in complete.
    "shm_peer_base_before_complete": (STRICT, {"rc": True}, {"rc": False}),
    "shm_two_processes": (SAME, {
        "peer": {"ready": True, "seen": "owner-wrote", "size": 8192},
        "owner_sees": "peer", "owner_ready": True,
    }),
    "shm_errors": (SAME, {"rc": [
        "InvalidArgument: Shared segment size must be in (0, 70368744177664]",
        "InvalidArgument: Shared segment world_size must not be zero",
        "InvalidArgument: Shared segment rank_id and owner_rank must be below world_size",
        "InvalidArgument: Shared segment rank_id and owner_rank must be below world_size",
        "NotImplemented: Shared segment mmap needs Ascend for HostRegister",
        "NotImplemented: This build has no VMM backend for shared segments",
        "InvalidArgument: Shared segment expects one blob per rank, got 1",
        "InvalidArgument: Shared segment blob has an unexpected length",
        "InvalidArgument: Shared segment declaration of rank 0 differs from the local one",
        "InvalidArgument: SharedSegment::Complete has already been called",
        "TypeError",
    ]}),
    "shm_odd_size": (SAME, {"rc": [5000, True]}),
}


def run(*args, timeout=240):
    return subprocess.run(
        [sys.executable, str(HERE / "engine_surface_cases.py"), *args],
        capture_output=True, text=True, env=ENV, cwd=str(HERE), timeout=timeout,
    )


def last_json(p):
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result (exit {p.returncode}); stderr tail:\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def results():
    return {impl: last_json(run(impl)) for impl in ("mooncake", "pagewire")}


@pytest.mark.parametrize("name", list(EXPECT))
def test_case(results, name):
    mc, pw = results["mooncake"][name], results["pagewire"][name]
    kind, *expected = EXPECT[name]
    assert mc == expected[0], f"Mooncake's behaviour changed: {mc}"
    assert pw == expected[-1], f"pagewire: {pw}"
    if kind == SAME:
        assert mc == pw


def test_every_case_is_expected(results):
    assert set(results["mooncake"]) == set(EXPECT) == set(results["pagewire"])


def test_free_with_a_wrong_length():
    """A block freed as a large buffer: Mooncake frees a pointer malloc never gave
    (its process aborts); pagewire refuses with -1."""
    mc = run("mooncake", "--one", "free_wrong_length", timeout=60)
    assert mc.returncode != 0 and not any(l.startswith("{") for l in mc.stdout.splitlines())
    pw = run("pagewire", "--one", "free_wrong_length", timeout=60)
    assert pw.returncode == 0 and last_json(pw) == {"rc": -1}


# ------------------------------------------------------------------ every public name

SURFACE = r"""
import inspect, json, sys
impl = sys.argv[1]
if impl == "mooncake":
    import mooncake.engine as m
else:
    import pagewire.mooncake_compat as m
out = {}
for n in dir(m):
    if n.startswith("_"):
        continue
    o = getattr(m, n)
    out[n] = {"kind": type(o).__name__ if not isinstance(o, type) else "class", "members": {}}
    if isinstance(o, type):
        for a in dir(o):
            if a.startswith("_"):
                continue
            v = getattr(o, a)
            if impl == "mooncake":
                doc = (getattr(v, "__doc__", None) or "").strip().split("\n")[0]
                sig = doc if callable(v) and "(" in doc else ""
            else:
                try:
                    sig = a + str(inspect.signature(v)) if callable(v) and not isinstance(v, type) else ""
                except (TypeError, ValueError):
                    sig = ""
            out[n]["members"][a] = sig
    elif callable(o):
        out[n]["sig"] = ((o.__doc__ or "").strip().split("\n")[0] if impl == "mooncake"
                         else n + str(inspect.signature(o)))
print(json.dumps(out))
"""


def _params(sig, pybind):
    """[(name, default)] of a signature; pybind11's positional-only ``argN`` become None
    and pagewire's positional-only parameters (before ``/``) too."""
    inner = sig[sig.index("(") + 1: sig.rindex(")")]
    parts = [p.strip() for p in re.split(r",(?![^\[]*\])", inner) if p.strip()]
    out, positional_only = [], not pybind and "/" in parts
    for part in parts:
        if part == "/":
            positional_only = False
            continue
        if part == "*" or part.split(":")[0].strip() == "self":
            continue
        name = part.split(":")[0].split("=")[0].strip()
        default = part.split("=", 1)[1].strip().strip("'\"") if "=" in part else None
        if (pybind and re.fullmatch(r"arg\d+", name)) or positional_only:
            name = None
        out.append((name, default))
    return out


def test_every_public_name_of_the_engine_module():
    """Every public name of the wheel's ``mooncake.engine`` (classes, their methods and
    attributes, functions) exists in pagewire, and every method and function takes the
    same parameters (names, positional-only, defaults)."""
    surfaces = {}
    for impl in ("mooncake", "pagewire"):
        p = subprocess.run([sys.executable, "-c", SURFACE, impl], capture_output=True,
                           text=True, env=ENV, cwd=str(HERE), timeout=60)
        surfaces[impl] = last_json(p)
    mc, pw = surfaces["mooncake"], surfaces["pagewire"]
    missing = sorted(set(mc) - set(pw))
    assert not missing, f"names the wheel has and pagewire lacks: {missing}"
    problems = []
    for n, entry in mc.items():
        for a, sig in entry["members"].items():
            if a not in pw[n]["members"]:
                problems.append(f"{n}.{a} missing")
            elif sig and _params(sig, True) != _params(pw[n]["members"][a], False):
                problems.append(f"{n}.{a}: {pw[n]['members'][a]} vs {sig}")
        if "sig" in entry and _params(entry["sig"], True) != _params(pw[n]["sig"], False):
            problems.append(f"{n}: {pw[n]['sig']} vs {entry['sig']}")
    assert not problems, "\n".join(problems)
