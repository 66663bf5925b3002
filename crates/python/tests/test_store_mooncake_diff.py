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
    mc = {**run("mooncake", "basic"), **run("mooncake", "capacity")}
    pw = {**run("pagewire", "basic"), **run("pagewire", "capacity")}
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
