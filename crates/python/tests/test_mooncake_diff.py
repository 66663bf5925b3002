"""Differential test: the same calls on the real Mooncake wheel
(mooncake-transfer-engine-non-cuda, installed by scripts/python-test.sh) and on
pagewire.mooncake_compat, over TCP on 127.0.0.1.

Every case is either SAME (both return what callers branch on, and the value is the one
the integration notes measured) or STRICT (Mooncake is lax, pagewire refuses; both values
are pinned, so a change on either side shows up). Each implementation runs in its own
process (diff_cases.py); calls that crash Mooncake's process run alone.

The table of results is written to target/mooncake-diff.md.

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
REPO = HERE.parents[2]
ENV = dict(os.environ, MC_TRANSFER_TIMEOUT="5")
for _v in ("MC_FORCE_TCP", "PAGEWIRE_TRANSPORT", "PAGEWIRE_AS_MOONCAKE"):
    ENV.pop(_v, None)

SAME = "same"
STRICT = "strict"

# case: (kind, expected Mooncake result, expected pagewire result); for SAME both are
# the one value. Results leave out the timing.
EXPECT = {
    "register_ok": (SAME, {"rc": 0}),
    "register_same_twice": (SAME, {"rc": -7}),
    "register_inner_overlap": (SAME, {"rc": -7}),
    "register_zero_length": (SAME, {"rc": -1}),
    "unregister_ok": (SAME, {"rc": 0}),
    "unregister_unknown": (SAME, {"rc": -3}),
    "batch_register_ok": (SAME, {"rc": 0, "unregister": 0}),
    "batch_register_overlap_inside": (SAME, {"rc": -7}),
    "batch_register_zero_length": (SAME, {"rc": -1}),
    "sync_write_ok": (SAME, {"rc": 0, "written": True}),
    "sync_read_ok": (SAME, {"rc": 0, "read": True}),
    "batch_write_32_pages": (SAME, {"rc": 0, "written": True}),
    "batch_tuples": (SAME, {"rc": 0}),
    "batch_empty": (SAME, {"rc": 0}),
    "batch_unequal_lists": (SAME, {"rc": -1, "written": False}),
    "sync_write_zero_length": (SAME, {"rc": 0}),
    "remote_outside_every_buffer": (SAME, {"rc": -1, "written": False}),
    "remote_straddles_end": (SAME, {"rc": -1, "written": False}),
    "batch_one_good_one_bad": (STRICT, {"rc": -1, "written": True}, {"rc": -1, "written": False}),
    "local_source_not_registered": (STRICT, {"rc": 0, "written": True}, {"rc": -1, "written": False}),
    "local_source_straddles_end": (STRICT, {"rc": 0, "written": True}, {"rc": -1, "written": False}),
    "sid_nothing_listening": (SAME, {"rc": -1}),
    "sid_unresolvable_host": (SAME, {"rc": -1}),
    "sid_without_port": (SAME, {"rc": -1}),
    "peer_accepts_and_closes": (SAME, {"rc": -1}),
    "peer_sends_garbage": (SAME, {"rc": -1}),
    "submit_write_no_listener": (SAME, {"rc": 0}),
    "async_write_ok": (SAME, {"rc": True, "status": 1, "written": True}),
    "async_wait_all_ok": (SAME, {"rc": 0, "nonzero_ids": True}),
    # Mooncake accepts the submission and fails it later; pagewire refuses it at once
    # with the failed-submission sentinel 0 (nothing posted).
    "async_bad_remote": (STRICT, {"rc": True, "status": -1}, {"rc": False, "status": None}),
    "async_bad_remote_wait_all": (STRICT, {"rc": True, "status": -1}, {"rc": False, "status": None}),
    "type_negative_address": (SAME, {"rc": "TypeError"}),
    "type_none_address": (SAME, {"rc": "TypeError"}),
    "type_float_length": (SAME, {"rc": "TypeError"}),
    "type_length_2_64": (SAME, {"rc": "TypeError"}),
    "type_negative_in_list": (SAME, {"rc": "TypeError"}),
    "initialize_twice": (SAME, {"rc": 0}),
    # Mooncake's second initialize replaces its engine under the cached sessions: the
    # next transfer fails. pagewire's is a no-op and the engine keeps working.
    "initialize_twice_then_write": (
        STRICT,
        {"first": 0, "again": 0, "rc": -1, "written": False},
        {"first": 0, "again": 0, "rc": 0, "written": True},
    ),
    "initialize_unknown_protocol": (SAME, {"rc": 0}),
    "initialize_rdma_without_hca": (SAME, {"rc": 0}),
    "initialize_http_metadata_unreachable": (SAME, {"rc": -1}),
    "rpc_port_in_range": (SAME, {"rc": True}),
    "probe_live_peer": (SAME, {"rc": 0}),
    "probe_no_listener": (SAME, {"rc": -102}),
    "notify_delivered_once": (
        SAME,
        {"rc": 0, "notifies": [["prefill-0", "req-42 done"]], "again": []},
    ),
    "first_buffer_address": (SAME, {"rc": True}),
}

TABLE_ROWS = []


def run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(HERE / "diff_cases.py"), *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=str(HERE),
        timeout=timeout,
    )


def last_json(p):
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result (exit {p.returncode}); stderr tail:\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_mooncake_wheel_is_installed():
    p = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert p.returncode == 0, (
        "the Mooncake wheel (mooncake-transfer-engine-non-cuda==0.3.13.post1) is not "
        "importable; scripts/python-test.sh installs it (it also needs libibverbs1):\n"
        + p.stderr[-2000:]
    )
    assert "pagewire" not in p.stdout  # the real one, not the import hook


@pytest.fixture(scope="module")
def results():
    out = {}
    for impl in ("mooncake", "pagewire"):
        p = run(impl)
        out[impl] = last_json(p)
    return out


def strip(r):
    return {k: v for k, v in r.items() if k != "seconds"}


def code(r):
    return ", ".join(f"{k}={v}" for k, v in r.items())


@pytest.mark.parametrize("name", list(EXPECT))
def test_case(results, name):
    mc = strip(results["mooncake"][name])
    pw = strip(results["pagewire"][name])
    kind, *expected = EXPECT[name]
    want_mc = expected[0]
    want_pw = expected[-1]
    TABLE_ROWS.append((name, kind, code(mc), code(pw)))
    assert mc == want_mc, f"Mooncake's behaviour changed: {mc}"
    assert pw == want_pw, f"pagewire: {pw}"
    if kind == SAME:
        assert mc == pw


def test_every_case_is_expected(results):
    assert set(results["mooncake"]) == set(EXPECT) == set(results["pagewire"])


@pytest.mark.parametrize(
    "name", ["get_rpc_port_before_initialize", "register_before_initialize", "initialize_unknown_scheme"]
)
def test_calls_that_crash_mooncake(name):
    mc = run("mooncake", "--one", name, timeout=60)
    # Mooncake: segfault (use before initialize) or abort (LOG(FATAL) on the scheme).
    assert mc.returncode != 0 and not any(l.startswith("{") for l in mc.stdout.splitlines()), (
        f"Mooncake did not crash (exit {mc.returncode}): {mc.stdout}"
    )
    pw = run("pagewire", "--one", name, timeout=60)
    assert pw.returncode == 0
    assert last_json(pw) == {"rc": -1}
    TABLE_ROWS.append((name, STRICT, f"process dies (exit {mc.returncode})", "rc=-1"))


def test_stopped_and_killed_peer():
    mc = last_json(run("mooncake", "--stopped", timeout=60))
    pw = last_json(run("pagewire", "--stopped", timeout=60))
    for r in (mc, pw):
        assert r["warm_write"] == 0
        assert r["stopped_write"] == -1
        assert 4.5 <= r["stopped_write_s"] < 7.0  # MC_TRANSFER_TIMEOUT=5
        assert r["killed_write"] == -1
    # Mooncake's probe of a stopped peer blocks (about 60 s); pagewire gives up in < 5 s.
    assert mc["stopped_probe"] == "blocked"
    assert pw["stopped_probe"] == -102 and pw["stopped_probe_s"] < 5.0
    TABLE_ROWS.append(("write to a SIGSTOPped peer", SAME, f"rc=-1 after {mc['stopped_write_s']} s", f"rc=-1 after {pw['stopped_write_s']} s"))
    TABLE_ROWS.append(("send_probe to a SIGSTOPped peer", STRICT, f"still blocked after {mc['stopped_probe_s']} s", f"rc=-102 after {pw['stopped_probe_s']} s"))
    TABLE_ROWS.append(("write to a killed peer", SAME, "rc=-1", "rc=-1"))


def _params(sig, pybind):
    """[(name or None for positional-only, default or None)] of a signature line."""
    inner = sig[sig.index("(") + 1 : sig.rindex(")")]
    out = []
    for part in [p.strip() for p in re.split(r",(?![^\[]*\])", inner) if p.strip()]:
        if part in ("/", "*") or part.startswith("self"):
            continue
        name = part.split(":")[0].split("=")[0].strip()
        default = part.split("=", 1)[1].strip() if "=" in part else None
        if default is not None:
            default = default.strip("'\"") if default not in ("None",) else "None"
        out.append((name, default))
    if pybind:
        out = [(None if re.fullmatch(r"arg\d+", n) else n, d) for n, d in out]
    return out


def test_signatures_match_mooncake():
    mc = last_json(run("mooncake", "--signatures"))
    pw = last_json(run("pagewire", "--signatures"))
    missing = sorted(set(mc) - set(pw))
    assert not missing, f"methods Mooncake has and pagewire lacks: {missing}"
    for name, line in mc.items():
        want = _params(line, pybind=True)
        got_sig = pw[name]
        positional_only = got_sig.split("/")[0] if "/" in got_sig else ""
        got = _params(got_sig, pybind=False)
        assert len(got) == len(want), f"{name}: {got_sig} vs {line}"
        for (wn, wd), (gn, gd) in zip(want, got):
            if wn is None:  # pybind11 arg0..: positional only, any name
                assert gn in positional_only, f"{name}: {gn} must be positional-only ({got_sig})"
            else:
                assert gn == wn, f"{name}: parameter {gn} should be named {wn}"
            assert (gd or None) == (wd or None) or (wd == "" and gd == ""), f"{name}.{wn}: default {gd!r} vs {wd!r}"


def test_write_table():
    """Writes the table of this run (after the cases above) for docs/python.md."""
    rows = ["| case | kind | Mooncake 0.3.13.post1 | pagewire |", "|---|---|---|---|"]
    for name, kind, mc, pw in TABLE_ROWS:
        rows.append(f"| {name} | {kind} | {mc} | {pw} |")
    out = REPO / "target" / "mooncake-diff.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(rows) + "\n")
    assert len(TABLE_ROWS) >= len(EXPECT)
