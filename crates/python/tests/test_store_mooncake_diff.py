"""Differential test of pagewire.mooncake_compat.MooncakeDistributedStore against the real
Mooncake Store (``mooncake_master`` and ``mooncake.store`` of the
mooncake-transfer-engine-non-cuda wheel, installed by scripts/python-test.sh), on
127.0.0.1 over TCP.

Each implementation runs ``store_diff_cases.py`` in its own process. Every case is SAME
(both give what callers branch on, and the value is pinned here) or DIFFERS (by design;
both values are pinned, so a change on either side shows). The table goes to
target/store-mooncake-diff.md. Without the wheel this fails; it never skips.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SAME, DIFFERS = "same", "differs"
MIB = 1 << 20

# case -> (kind, value) for SAME, (kind, mooncake, pagewire, why) for DIFFERS.
EXPECT = {
    "setup": (SAME, 0),
    "register_ok": (SAME, 0),
    "register_twice": (SAME, -600),
    "register_zero": (SAME, -600),
    "unregister_unknown": (SAME, -600),
    "put_batch": (SAME, [0, 0, 0]),
    "put_existing": (SAME, [0]),
    "existing_keeps_first": (SAME, [[4096], True]),
    "put_mismatched": (SAME, [-600, -600]),
    "put_empty": (SAME, []),
    "put_size_zero": (SAME, [-600]),
    "put_unregistered": (DIFFERS, [0], [-600], "pagewire refuses a source outside registered memory"),
    "get_batch": (SAME, [[4096, 4096, -704], True]),
    "get_small_buffer": (SAME, [-600]),
    "get_larger_buffer": (SAME, [4096]),
    "get_mismatched": (SAME, [-600, -600]),
    "get_into": (SAME, 4096),
    "multi_put": (SAME, [0]),
    "multi_get": (SAME, [[8192], True]),
    "exist": (SAME, [[1, 0], 1, 0, []]),
    "warm_put": (SAME, 0),
    "warm_get": (SAME, True),
    "warm_size": (SAME, 4096),
    "get_missing": (SAME, ["", -704]),
    "exist_leases": (SAME, [1, -706]),
    "remove_leased": (SAME, [-706, 0, -704]),
    "batch_remove": (SAME, [0, -704]),
    "replicas_best_effort": (SAME, [0]),
    "hard_pin": (SAME, [0]),
    "same_node": (SAME, [-600, -600]),
    "config_fields": (
        SAME,
        sorted(
            [
                "data_type", "dfs_replica_num", "group_ids", "nof_replica_num",
                "prefer_alloc_in_same_node", "preferred_nof_segments", "preferred_segment",
                "preferred_segments", "replica_num", "soft_pin_action", "soft_pin_ttl_ms",
                "with_hard_pin",
            ]
        ),
    ),  # fmt: skip
    "remove_all": (SAME, True),
    "health": (SAME, 0),
    "close": (SAME, 0),
    "health_after_close": (SAME, 1),
    # capacity phase, on a fresh master and store
    "cap_setup": (SAME, 0),
    "cap_register": (SAME, 0),
    "object_larger_than_segment": (SAME, [-200]),
    "one_batch_overfills": (SAME, [0] * 16 + [-200] * 4),
    "full_then_put": (
        DIFFERS,
        [-200] * 4,
        [0] * 4,
        "a put that finds no room evicts synchronously in pagewire; Mooncake refuses and evicts later",
    ),
    "cap_remove_all": (SAME, True),
    "fill": (SAME, [0] * 7),
    "lease_all": (SAME, [2 * MIB] * 7),
    "no_space_when_leased": (SAME, [0, -200]),
    "cap_close": (SAME, 0),
}

# The "surface" phase: the calls beyond the zero-copy core (store_diff_cases.surface).
EXPECT.update({
    "setup_sizes_16MB": (SAME, 0),
    "setup_sizes_16777216": (SAME, 0),
    "setup_sizes_16XB": (SAME, -600),
    "setup_sizes_0.5GB": (SAME, 0),
    "setup_positional_string": (SAME, "TypeError"),
    "get_hostname_form": (SAME, ["localhost", True]),
    "surface_setup": (SAME, 0),
    "surface_register": (SAME, 0),
    "put_batch_values": (SAME, 0),
    "put_batch_existing": (SAME, [0, "one"]),
    "put_batch_errors": (SAME, [-600, 0, -600]),
    "get_batch": (SAME, ["one", "two!", "three", ""]),
    "get_batch_empty": (SAME, [""]),
    "get_buffer": (SAME, [True, 4, "two!", None]),
    "batch_get_buffer": (SAME, ["one", None, []]),
    "put_parts": (SAME, [0, "abcdef"]),
    "put_parts_none": (SAME, [0, 0]),
    "put_from_with_metadata": (SAME, [0, True]),
    "put_from_with_metadata_empty": (SAME, [0, 0]),
    "upsert": (SAME, [0, 0, "twotwo"]),
    "upsert_leased": (SAME, ["one", 0, "new"]),
    "upsert_batch": (SAME, [0, ["x", "yy"]]),
    "upsert_parts": (SAME, [0, "p1p2"]),
    "upsert_from": (SAME, [0, 0, 100]),
    "batch_upsert_from": (SAME, [[0, 0], 200, 300]),
    "upsert_errors": (SAME, [-600, -600]),
    "get_replica_desc": (SAME, [1, True, False, False, 3, 4, True, True, "RuntimeError: Expected DiskDescriptor"]),
    "get_replica_desc_missing": (SAME, []),
    "batch_get_replica_desc": (SAME, ["pb2", "pm"]),
    "batch_replica_clear": (SAME, [["x"], ["y"], [], [0, 0, 1], []]),
    "remove_by_regex_bad": (SAME, -600),
    "remove_by_regex": (SAME, [2, [0, 0, 1]]),
    "get_into_ranges": (SAME, [[[[10, 20], [-704]], [[1]]], True]),
    "get_into_ranges_errors": (
        SAME,
        [[[[-600]]], [[[-600, -600]]], [[[-600]], [[-600]]], [[[-600]]], [[[-600]]], [[[0]]], []],
    ),
    "put_session_start": (SAME, [[0, 0, -705], 0]),
    "put_session_ranges": (SAME, [[-600, -600], [100, -600], [-600]]),
    "put_session_end": (SAME, [[0, 0, -600], True, 50, [-600]]),
    "put_session_refusals": (SAME, [[-705], [-600]]),
    "put_session_revoke": (SAME, [[0], [0], 0, [-600]]),
    "get_session": (SAME, [[0, -704], [30, -600], True, 0, [-600]]),
    "tasks": (SAME, [[[0, 0], -600], [[0, 0], -600], [None, -1400]]),
    "segments": (SAME, [{"ret": -1, "segment_ids": []}, -1, -1, 0, 0, 0, -600]),
    "allocate_and_mount_segment": (
        DIFFERS,
        0,
        -1012,
        "pagewire's client has one segment; Mooncake mounts another on request",
    ),
    "setup_dummy_nobody": (SAME, -1),
    "nof_register": (SAME, [-1, -1]),
    "safetensor": (SAME, [-1100, None]),
    "host_allocator": (SAME, [True, 0, -1]),
    "alloc_func_addrs": (SAME, [True, True]),
    "bind_to_numa_node_missing": (SAME, None),
    "soft_pin_ttl_ms": (SAME, [None, "TypeError", None, 5]),
    "pool_uninitialised": (SAME, "RuntimeError: MooncakeDistributedStore is not initialized"),
    "pool_lease": (SAME, ["BufferLease", 1000, 1000, 0, "pool", "BufferLease"]),
    "pool_release": (SAME, ["RuntimeError: buffer lease is closed", None]),
    "pool_with": (SAME, 10),
    "pool_errors": (
        SAME,
        ["RuntimeError: requested buffer size exceeds pool capacity", None, None, "RuntimeError: buffer pool is closed"],
    ),
    "pool_exhaustion": (
        SAME,
        ["RuntimeError: buffer pool is exhausted", "RuntimeError: timed out waiting for buffer",
         "RuntimeError: timeout must be non-negative",
         "RuntimeError: requested buffer size exceeds pool capacity", "TypeError"],
    ),
    "pool_waits_for_release": (SAME, [4 * MIB, 8 * MIB]),
    "pool_zero": (SAME, 0),
    "descriptor_defaults": (
        SAME,
        [[0, 0, ""], ["", 0, 1, None, None, None], [], ["as_stored", None], [64, [1024]], [0, 0, ""]],
    ),
    "surface_close": (SAME, 0),
})  # fmt: skip

#: The wheel's tensor calls without torch (the test virtualenv has none), which pagewire
#: answers the same whatever the argument: a read gives None (per key for a batch), a
#: write -600 (per key).
TENSOR_METHODS = sorted(
    n for n in dir(__import__("pagewire.mooncake_compat").mooncake_compat.MooncakeDistributedStore)
    if "tensor" in n and "safetensor" not in n and not n.startswith("_")
)  # fmt: skip


def tensor_expectation() -> dict:
    out = {}
    for name in TENSOR_METHODS:
        one = None if "get" in name and "cuda" not in name else -600
        out[name] = [one] if name.startswith("batch_") else one
    return out


EXPECT["tensor_calls"] = (SAME, tensor_expectation())


def run(impl: str, phase: str) -> dict:
    env = dict(os.environ)
    env.pop("PAGEWIRE_TRANSPORT", None)
    r = subprocess.run(
        [sys.executable, str(HERE / "store_diff_cases.py"), impl, phase],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, f"{impl} cases failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results():
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.fail(
            "the Mooncake wheel is missing (pip install "
            f"mooncake-transfer-engine-non-cuda==0.3.13.post1; scripts/python-test.sh does): {e}"
        )
    phases = ("basic", "capacity", "surface")
    mc = {k: v for phase in phases for k, v in run("mooncake", phase).items()}
    pw = {k: v for phase in phases for k, v in run("pagewire", phase).items()}
    rows = ["| case | kind | Mooncake | pagewire |", "| --- | --- | --- | --- |"]
    for case, exp in EXPECT.items():
        rows.append(f"| {case} | {exp[0]} | `{mc.get(case)}` | `{pw.get(case)}` |")
    out = REPO / "target" / "store-mooncake-diff.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(rows) + "\n")
    return mc, pw


@pytest.mark.parametrize("case", list(EXPECT))
def test_case(results, case):
    mc, pw = results
    exp = EXPECT[case]
    if exp[0] == SAME:
        assert mc[case] == exp[1], f"Mooncake changed: {mc[case]!r}"
        assert pw[case] == exp[1], f"pagewire differs from Mooncake: {pw[case]!r}"
    else:
        _, want_mc, want_pw, why = exp
        assert mc[case] == want_mc, f"Mooncake changed: {mc[case]!r}"
        assert pw[case] == want_pw, f"pagewire changed ({why}): {pw[case]!r}"


def test_every_case_ran(results):
    mc, pw = results
    assert set(mc) == set(pw) == set(EXPECT)
