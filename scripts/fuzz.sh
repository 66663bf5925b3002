#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/fuzz_targets/ for a bounded time and keeps what it
# finds: each target's corpus lives in the repository as hex lines
# (crates/transport/tests/data/<target>.corpus, replayed on stable Rust by
# crates/transport/tests/fuzz_corpus.rs); it seeds the run, and is rewritten from the
# minimized corpus afterwards (commit the change). A crash fails the run; its input is
# added to the corpus file first, so the stable replay reproduces it from then on.
#
#   scripts/fuzz.sh [--seconds N] [TARGET...]     (N: PAGEWIRE_FUZZ_SECONDS, default 60)
#
# Needs a nightly toolchain and cargo-fuzz. Without them it says so and exits 0: the host
# suite's corpus replay is then the only fuzz check.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

secs=${PAGEWIRE_FUZZ_SECONDS:-60}
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) secs=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) targets+=("$1"); shift ;;
    esac
done

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "fuzz: SKIPPED: no nightly toolchain (rustup toolchain list); only the corpus replay (tests/fuzz_corpus.rs) runs"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: SKIPPED: cargo-fuzz is not installed (cargo install cargo-fuzz --locked); only the corpus replay (tests/fuzz_corpus.rs) runs"
    exit 0
fi
if [ ${#targets[@]} -eq 0 ]; then
    for f in fuzz/fuzz_targets/*.rs; do targets+=("$(basename "$f" .rs)"); done
fi

data=crates/transport/tests/data
status=0
for t in "${targets[@]}"; do
    hex="$data/$t.corpus"
    # A target whose corpus lives with another crate's tests (the store's protocol decoder:
    # crates/store/tests/data/) keeps it there.
    for other in crates/*/tests/data/"$t".corpus; do
        [ -e "$other" ] && hex="$other"
    done
    dir="fuzz/corpus/$t"
    rm -rf "$dir" "fuzz/artifacts/$t"
    mkdir -p "$dir"
    # Hex lines -> one file per input ('-' is the empty input).
    before=$(python3 - "$hex" "$dir" <<'PY'
import hashlib, os, sys
hexfile, out = sys.argv[1], sys.argv[2]
n = 0
if os.path.exists(hexfile):
    for line in open(hexfile):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        b = b"" if line == "-" else bytes.fromhex(line)
        open(os.path.join(out, hashlib.sha1(b).hexdigest()), "wb").write(b)
        n += 1
print(n)
PY
)
    echo "== fuzz: $t for ${secs} s (seed corpus: $before inputs from $hex)"
    t0=$SECONDS
    if (cd fuzz && cargo +nightly fuzz run "$t" "corpus/$t" -- \
            -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1); then
        # Keep what it found, minimized.
        (cd fuzz && cargo +nightly fuzz cmin "$t" "corpus/$t" >/dev/null 2>&1)
        found=ok
    else
        echo "fuzz: $t FAILED (a crash or a leak); its input goes into $hex"
        status=1
        found=crash
    fi
    after=$(python3 - "$hex" "$dir" "fuzz/artifacts/$t" "$t" "$found" <<'PY'
import datetime, os, sys
hexfile, corpus, artifacts, target, found = sys.argv[1:6]
def inputs(d):
    if not os.path.isdir(d):
        return []
    return [open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))]
# The file: a header, "# seeds: ..." and the seeds, "# minimized:" and the rest. The
# seeds stay whatever cmin keeps (a valid frame of every kind: cmin may drop one whose
# coverage other inputs reach, and the corpus replay requires every kind).
header, seeds, old, part = [], [], set(), "header"
if os.path.exists(hexfile):
    for l in open(hexfile):
        l = l.rstrip("\n")
        if l.startswith("# seeds"):
            part = "seeds"
        elif l.startswith("# minimized"):
            part = "rest"
        elif l.startswith("#"):
            if part == "header":
                header.append(l)
        elif l.strip():
            (seeds.append if part == "seeds" else old.add)(l.strip())
crashes = {b.hex() or "-" for b in inputs(artifacts)}
if found == "ok":
    lines = {b.hex() or "-" for b in inputs(corpus)}  # minimized by cmin
else:
    lines = old | crashes  # the run's other finds are not minimized: keep the old set
lines -= set(seeds)
day = datetime.date.today().isoformat()
with open(hexfile, "w") as f:
    for h in header or [f"# Corpus of fuzz/fuzz_targets/{target}.rs, one input per line, hex."]:
        f.write(h + "\n")
    f.write("# seeds: kept by scripts/fuzz.sh whatever `cargo fuzz cmin` keeps\n")
    for l in seeds:
        f.write(l + "\n")
    f.write(f"# minimized: {len(lines)} inputs kept by `cargo fuzz cmin` on {day}\n")
    for l in sorted(lines):
        f.write(l + "\n")
print(len(seeds) + len(lines))
PY
)
    echo "fuzz: $t: $found after $((SECONDS - t0)) s; corpus $before -> $after inputs ($hex)"
done
exit $status
