"""Differential test of the store's tensor calls: pagewire.mooncake_compat's
MooncakeDistributedStore against the real Mooncake Store (``mooncake_master`` and
``mooncake.store`` of mooncake-transfer-engine-non-cuda 0.3.13.post1) on 127.0.0.1 over
TCP, with torch. Run by scripts/tensor-check.sh in scripts/sglang-check.sh's virtualenv
(the one with torch; pytest's .venv has none): ``python tensor_mooncake_diff.py``.

Each implementation runs tensor_diff_cases.py in its own process. Checked:

* every case of ``EXPECT``: SAME (both give the pinned value) or DIFFERS (both values
  pinned, with the reason; docs/python.md lists each);
* the on-store bytes: for every case that stores objects, the SHA-256 of the raw objects
  (read with ``get``) is the same under both, i.e. the format is Mooncake's byte for byte;
* cross-reads: every object one side stored, put as raw bytes into the other, reads back
  with ``get_tensor`` as the same tensor (dtype, shape, bytes).

Prints one line per check and ``N passed, M failed``; exits non-zero on a failure, or
when torch, Mooncake's wheel or pagewire is missing (it never skips). The table goes to
target/tensor-mooncake-diff.md.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SAME, DIFFERS = "same", "differs"

DTYPES = [
    ("float32", 4), ("float64", 8), ("float16", 2), ("bfloat16", 2), ("int8", 1), ("uint8", 1),
    ("int16", 2), ("uint16", 2), ("int32", 4), ("uint32", 4), ("int64", 8), ("uint64", 8),
    ("bool", 1), ("float8_e4m3fn", 1), ("float8_e5m2", 1),
]  # fmt: skip
# shape name -> (shape read back: a 0-d tensor comes back 1-d, as Mooncake's reader gives it)
SHAPES = {"0d": [1], "1d": [5], "4d": [2, 3, 2, 2], "empty": [0, 3]}
HEADER = 304


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def t(dtype, shape, same=True):
    return [dtype, list(shape), same]


EXPECT = {"setup": (SAME, [0, 0])}
for _dt, _size in DTYPES:
    for _name, _shape in SHAPES.items():
        EXPECT[f"put_get_{_dt}_{_name}"] = (SAME, [0, HEADER + _numel(_shape) * _size, t(_dt, _shape)])

EXPECT.update({
    "unsupported_dtype": (SAME, [-600, -600, [-600, 0]]),
    "not_a_tensor": (SAME, [-600, -600]),
    "nine_dims": (SAME, -600),
    "eight_dims": (SAME, [0, t("float32", [1] * 7 + [2], None)]),
    "non_contiguous": (SAME, [False, 0, t("int64", [4, 3])]),
    "missing": (SAME, [None, [None]]),
    "not_a_tensor_object": (SAME, None),
    "uninitialised": (SAME, [-600, None, [-600], [-600], -600]),
    "put_existing_keeps_first": (SAME, [0, 0, t("float32", [4])]),
    "upsert_replaces": (SAME, [0, t("float32", [4]), 0, t("float32", [4])]),
    "pub": (SAME, [0, t("int16", [2, 2]), 0, t("float32", [4]), [0, 0], [0, 0],
                   [t("int16", [2, 2]), t("int16", [2, 2]), t("float32", [4])]]),
    "upsert_not_a_tensor_keeps_old": (SAME, [-600, t("float32", [4])]),
    "batch_put": (SAME, [0, -600, 0]),
    "batch_put_mismatch": (SAME, [-600, -600]),
    "batch_put_empty": (SAME, []),
    "batch_get": (SAME, [t("bfloat16", [3, 4]), None, t("uint8", [7])]),
    "batch_get_empty": (SAME, []),
    "batch_upsert": (SAME, [[0, 0], t("uint8", [7]), [-600], []]),
    "larger_than_local_buffer": (
        DIFFERS,
        [0, None],
        [0, t("float32", [5, 1 << 20])],
        "a read larger than the local buffer gets a buffer of its own in pagewire; Mooncake's get_tensor fails",
    ),
    "get_into": (SAME, [368, t("float16", [4, 8]), True]),
    "get_into_exact": (SAME, t("float16", [4, 8])),
    "get_into_too_small": (SAME, [None, None]),
    "get_into_missing": (SAME, None),
    "get_into_null": (SAME, None),
    "get_into_not_a_tensor": (SAME, None),
    "batch_get_into": (SAME, [t("float16", [4, 8]), None, None]),
    "batch_get_into_mismatch": (SAME, [-600, -600]),
    "batch_get_into_null": (SAME, [-600, -600]),
    "batch_get_into_empty": (SAME, []),
    "put_from": (SAME, [0, t("int32", [3, 5])]),
    "put_from_errors": (SAME, [-600, -600, -600, -600]),
    "batch_put_from": (SAME, [[0, 0], t("bool", [6])]),
    "batch_put_from_one_bad": (SAME, [-600, -600]),
    "batch_put_from_edges": (SAME, [[], [-600, -600]]),
    "upsert_from": (SAME, [0, t("bool", [6]), -600, t("bool", [6])]),
    "batch_upsert_from": (SAME, [[0, 0], t("bool", [6]), t("int32", [3, 5]), []]),
    "put_from_unregistered": (
        DIFFERS,
        [0, t("int32", [3, 5])],
        [-600, None],
        "pagewire reads a caller's serialized tensor only from registered memory, as put_from",
    ),
    "parallelism_plain": (SAME, [0, t("float32", [4, 2]), t("float32", [4, 2]), [0, -600], [t("int8", [3]), None], 0,
                                 t("int8", [3]), [0, 0], t("float32", [4, 2]), [], [-600]]),
    "parallelism_from": (SAME, [0, t("float32", [4, 2]), 0, -600, 0, [0, 0], [-600, -600], []]),
    "parallelism_into": (SAME, [t("float32", [4, 2]), None, None, [t("float32", [4, 2]), None, t("int8", [3])],
                                [None]]),
    "read_target_mode": (SAME, ["full", "RuntimeError: Unsupported ReadTarget mode", "shard"]),
    "writer_partition": (SAME, [0, None, 0, t("float32", [4, 6]), None, [0, 1, 1, 1], None, 0, t("float32", [4, 2])]),
    "writer_partition_empty": (SAME, [0, 0, t("float32", [0, 4])]),
    "writer_partition_refusals": (SAME, [-600, -600, -600, -600, -600, [0]]),
    "writer_partition_batch": (SAME, [[0, 0], None, [0], [t("int16", [6, 2]), t("float32", [4, 6])], [-600, -600], 0,
                                      t("float32", [4, 6]), [0], t("float32", [4, 6])]),
    "writer_partition_into": (SAME, [t("float32", [4, 6]), None, t("float32", [4, 2])]),
    "writer_partition_from": (SAME, [0, [0], t("float32", [2, 3, 2, 2]), 0, -600]),
    "parallelism_specs": (SAME, [0, -600]),
    "tp_spec": (SAME, [0, [0, 1, 0, 1, 0], t("float32", [4, 3]), None, 0, t("float32", [4, 6]), None, None,
                       [-600] * 5, [0, 0, 0]]),
    "tp_spec_reads": (SAME, [t("float32", [4, 3]), t("float32", [4, 6]), [0, 0],
                             [t("int32", [4, 2]), t("float32", [4, 3])], [-600, -600], 0, t("int32", [4, 2])]),
    "tp_spec_into": (SAME, [t("float32", [4, 6]), t("float32", [4, 3]), None]),
    "tp_spec_from": (SAME, [0, [0, 1, 1, 0], t("float32", [4, 3]), [0], t("float32", [4, 6]), -600]),
    "tp_spec_reshard": (SAME, [t("float32", [4, 3], None), t("float32", [4, 2]), t("float32", [4, 6]),
                               t("float32", [4, 2]), t("float32", [4, 3], None), t("float32", [4, 1]), None,
                               t("float32", [4, 3], None), None, None]),
    "multi_spec": (SAME, [0, [1, 0, 1, 0, 0], t("float32", [4, 3]), None, 0, t("float32", [4, 6]), None,
                          t("float32", [4, 2]), t("float32", [4, 1]), None, None, None, 0, [1, 1], t("float32", [1, 6]),
                          None, None]),
    "generic_spec": (SAME, [0, [1, 0, 0], t("float32", [4, 6]), None, None, t("float32", [4, 6]), 0, [1],
                            t("float32", [6]), 0, t("float32", [4, 6]), [0, 0],
                            [t("float32", [4, 6]), t("float32", [4, 3]), None]]),
    "multi_spec_refusals": (SAME, [-600] * 11 + [[0, 0], None, [0, -600]]),
    "multi_spec_from": (SAME, [0, [1, 1, 0], t("float32", [4, 6]), t("float32", [4, 2]), None, 0, t("float32", [4, 6]),
                               [-600], t("float32", [4, 3]), t("float32", [4, 6]), t("float32", [4, 3]),
                               t("float32", [4, 2]), t("float32", [4, 6]), t("float32", [4, 3], None), 0,
                               t("float32", [1], None)]),
    "multi_spec_upsert": (SAME, [[0], None, t("float32", [4, 2]), t("float32", [4, 3]), t("float32", [4, 6]), None, 0,
                                 [t("float32", [4, 2]), t("float32", [4, 6]), None]]),
    "tp_refusals": (SAME, [-600, -600, -600, -600, -600, -600, [0, 0, 0]]),
    "tp_read_other_rank": (SAME, [None, None, None]),
    "batch_tp": (SAME, [[0, -600, -600, 0], [t("int8", [1, 4]), None, t("bfloat16", [3, 2])], [-600], [], [0],
                        [t("int8", [2, 4]), None]]),
    "pub_tp": (SAME, [0, t("bfloat16", [6, 1]), [0, 0], t("bfloat16", [3, 2])]),
    "tp_into": (SAME, [t("int8", [1, 4]), None, t("int8", [2, 4]),
                       [t("int8", [1, 4]), t("bfloat16", [3, 2]), None], [-600, -600]]),
    "tp_from": (SAME, [-600, None, 0, 0, -600, 0, t("float32", [2, 3, 2, 2]), [0, -600], t("float32", [2, 3, 2, 1])]),
})  # fmt: skip


def _tp_expect(name, shape, dtype):
    """Tensor parallelism: tp_size 1 stores the plain key; otherwise every rank's slice
    under ``key_tp_<rank>`` when ``split_dim`` divides evenly, else -600 and nothing."""
    for tp in (1, 2, 4):
        for split in range(len(shape)):
            ok = shape[split] % tp == 0
            local = list(shape)
            local[split] //= tp
            if tp == 1:
                exist, reads = [1, 0], [t(dtype, shape)]
            else:
                exist = [0] + [1 if ok else 0] * tp
                reads = [t(dtype, local) if ok else None] * tp
            EXPECT[f"tp_{name}_size{tp}_dim{split}"] = (SAME, [0 if ok else -600, exist, reads])


_tp_expect("f16_4x6", [4, 6], "float16")
_tp_expect("i32_8x4x2", [8, 4, 2], "int32")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEWIRE_AS_MOONCAKE", "PAGEWIRE_TRANSPORT")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run(impl: str, out: Path, other: Path = None) -> dict:
    cmd = [sys.executable, str(HERE / "tensor_diff_cases.py"), impl, str(out)] + ([str(other)] if other else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=HERE)
    if r.returncode != 0:
        raise RuntimeError(f"{impl} cases failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(out.read_text())


def prerequisites() -> list:
    """What this interpreter lacks among torch, Mooncake's wheel and pagewire."""
    missing = []
    for mod, what in (("torch", "torch"), ("mooncake.store", "mooncake-transfer-engine-non-cuda==0.3.13.post1"),
                      ("pagewire.mooncake_compat", "the pagewire wheel")):  # fmt: skip
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, env=_env())
        if r.returncode != 0:
            missing.append(f"{what} ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'import failed'})")
    return missing


def main() -> int:
    missing = prerequisites()
    if missing:
        print(f"tensor diff: {sys.executable} lacks " + "; ".join(missing))
        print("0 passed, 1 failed")
        return 1
    checks = []  # (ok, name, why)
    with tempfile.TemporaryDirectory() as d:
        mc_path, pw_path = Path(d) / "mooncake.json", Path(d) / "pagewire.json"
        mc, pw = run("mooncake", mc_path), run("pagewire", pw_path)
        pw_cross = run("pagewire", Path(d) / "pw-cross.json", mc_path)["cross"]
        mc_cross = run("mooncake", Path(d) / "mc-cross.json", pw_path)["cross"]
    mcc, pwc = mc["cases"], pw["cases"]
    rows = ["| case | kind | Mooncake | pagewire |", "| --- | --- | --- | --- |"]
    for case, exp in EXPECT.items():
        got_mc, got_pw = mcc.get(case), pwc.get(case)
        rows.append(f"| {case} | {exp[0]} | `{got_mc}` | `{got_pw}` |")
        if exp[0] == SAME:
            why = "" if got_mc == exp[1] else f"Mooncake changed: {got_mc!r}"
            why = why or ("" if got_pw == exp[1] else f"pagewire differs from Mooncake: {got_pw!r}")
        else:
            _, want_mc, want_pw, reason = exp
            why = "" if got_mc == want_mc else f"Mooncake changed: {got_mc!r}"
            why = why or ("" if got_pw == want_pw else f"pagewire changed ({reason}): {got_pw!r}")
        checks.append((not why, case, why))
    extra = sorted(set(mcc) ^ set(EXPECT)) + sorted(set(pwc) ^ set(EXPECT))
    checks.append((not extra, "every case ran and is expected", f"unexpected or missing: {extra}"))
    for case in sorted(set(mc["digests"]) | set(pw["digests"])):
        same = mc["digests"].get(case) == pw["digests"].get(case)
        checks.append((same, f"bytes:{case}", "" if same else "the stored objects differ"))
    for side, objects, cross in (("mooncake->pagewire", mc["objects"], pw_cross),
                                 ("pagewire->mooncake", pw["objects"], mc_cross)):  # fmt: skip
        for key, (_raw, fingerprint) in objects.items():
            ok = cross.get(key) == [0, fingerprint]
            checks.append((ok, f"cross:{side}:{key}", "" if ok else f"{cross.get(key)} != {[0, fingerprint]}"))
    (REPO / "target").mkdir(exist_ok=True)
    (REPO / "target" / "tensor-mooncake-diff.md").write_text("\n".join(rows) + "\n")
    failed = [c for c in checks if not c[0]]
    for ok, name, why in checks:
        if not ok or os.environ.get("VERBOSE"):
            print(f"{'PASS' if ok else 'FAIL'} {name}{' (' + why + ')' if why else ''}")
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
