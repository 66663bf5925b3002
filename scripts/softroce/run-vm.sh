#!/usr/bin/env bash
# Boot the soft-RoCE guest once and run one job script in it (see docs/testing.md).
#
#   run-vm.sh [OPTIONS] JOB_SCRIPT     run JOB_SCRIPT (bash) in the guest, cwd /run/job
#   run-vm.sh [OPTIONS] --shell        interactive shell in the guest
#
# Options:
#   --timeout S      wall-clock limit for the whole run (default 600)
#   --mem MB         guest RAM (default 1024; the overlay's writes live there)
#   --cpus N         vCPUs (default 1: rxe is as fast with 1 under TCG)
#   --two-devices    rxe0 on veth0 and rxe1 on veth1 (traffic crosses the veth pair)
#   --two-rails      two veth pairs: rxe0, rxe1 on veth0, veth1 and their peers rxe0p,
#                    rxe1p on veth0p, veth1p (two engines with two rails each, a rail's
#                    traffic crosses its own pair, so one rail's link can be taken down)
#   --mtu N          netdev MTU (default 9000, RoCE MTU 4096)
#   --append STR     extra kernel parameters (e.g. "sr.ip=10.9.9.1/24")
#   --out DIR        host directory shared read-write at the same path in the guest,
#                    exported there as $SOFTROCE_OUT (default: <repo>/target/softroce-out)
#   --kvm auto|on|off  hardware KVM only when kvm_intel/kvm_amd is loaded (default auto)
#   --keep           keep the job directory (console.log, exit_code) even on success
#   --quiet          print only the job's own output (no kernel / init lines)
#
# Exit status: the job's status; 124 timeout; 125 the guest reported nothing (panic, crash,
# qemu failure); 123 guest setup failed (modules, mounts, rxe device creation).
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${SOFTROCE_CACHE:-$repo/.softroce}"

timeout=600 mem=1024 cpus=1 net=dummy mtu=9000 append="" kvm=auto keep=0 quiet=0 shell=0
outdir="$repo/target/softroce-out" job=""
while (($#)); do
    case "$1" in
        --timeout) timeout=$2; shift ;;
        --mem) mem=$2; shift ;;
        --cpus) cpus=$2; shift ;;
        --two-devices) net=veth ;;
        --two-rails) net=rails ;;
        --mtu) mtu=$2; shift ;;
        --append) append="$append $2"; shift ;;
        --out) outdir=$2; shift ;;
        --kvm) kvm=$2; shift ;;
        --keep) keep=1 ;;
        --quiet) quiet=1 ;;
        --shell) shell=1 ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "run-vm: unknown option $1" >&2; exit 2 ;;
        *) job=$1 ;;
    esac
    shift
done
if ((!shell)) && [[ -z "$job" || ! -f "$job" ]]; then
    echo "run-vm: need a job script (or --shell)" >&2
    exit 2
fi

say() { echo "softroce: $*" >&2; }

img="$("$here/build-image.sh")" || { say "image build failed"; exit 125; }
command -v qemu-system-x86_64 >/dev/null || { say "qemu-system-x86_64 missing (scripts/setup.sh --vm)"; exit 125; }

mkdir -p "$cache/jobs" "$outdir"
outdir="$(cd "$outdir" && pwd)"
[[ "$outdir" != *[[:space:]]* ]] || { say "--out path must not contain spaces: $outdir"; exit 2; }
# Job dirs older than a day are leftovers of killed runs.
find "$cache/jobs" -mindepth 1 -maxdepth 1 -mmin +1440 -exec rm -rf {} + 2>/dev/null
jobdir="$(mktemp -d "$cache/jobs/job.XXXXXX")"
chmod 755 "$jobdir"
if ((!shell)); then
    cp "$job" "$jobdir/job.sh"
fi
echo "$outdir" >"$jobdir/outdir"
echo "$repo" >"$jobdir/cwd"

# /dev/kvm may be a PVM hypervisor that cannot boot Debian's kernel: only trust it when a
# hardware KVM module is loaded.
accel="-accel tcg -cpu max"
case "$kvm" in
    on) accel="-accel kvm -cpu host" ;;
    auto) if [[ -w /dev/kvm ]] && { [[ -d /sys/module/kvm_intel ]] || [[ -d /sys/module/kvm_amd ]]; }; then
              accel="-accel kvm -cpu host"
          fi ;;
esac

# --quiet also keeps kernel warnings off the console, so stdout is the job's own output.
kargs="console=ttyS0 loglevel=$((quiet ? 1 : 4)) panic=-1 rdinit=/init tsc=reliable mitigations=off"
kargs="$kargs sr.net=$net sr.mtu=$mtu"
((shell)) && kargs="$kargs sr.shell=1"
kargs="$kargs $append"

# shellcheck disable=SC2206
qemu=(qemu-system-x86_64 -M pc $accel -smp "$cpus" -m "$mem" -nodefaults -no-reboot
      -display none -monitor none -pidfile "$jobdir/qemu.pid"
      -chardev "stdio,id=con0,signal=off,logfile=$jobdir/console.log" -serial chardev:con0
      -kernel "$img/vmlinux" -initrd "$img/initramfs.cpio" -append "$kargs"
      -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
      -virtfs "local,path=$jobdir,mount_tag=job,security_model=none"
      -virtfs "local,path=$outdir,mount_tag=out,security_model=none"
      -nic none)

# --foreground keeps qemu in the caller's process group: Ctrl-C reaches it, and the
# interactive shell can read the terminal. The timeout still kills it.
t0=$(date +%s%N)
if ((shell)); then
    timeout --foreground -k 5 "$timeout" "${qemu[@]}"
    qrc=$?
else
    ((quiet)) || say "booting guest ($accel, ${cpus} vCPU, ${mem} MiB, net=$net, timeout ${timeout}s), job dir $jobdir"
    if ((quiet)); then
        timeout --foreground -k 5 "$timeout" "${qemu[@]}" </dev/null 2>&1 |
            sed -u -n -e 's/\r$//' -e '/^SOFTROCE_JOB_BEGIN$/,/^SOFTROCE_JOB_END$/{/^SOFTROCE_JOB_\(BEGIN\|END\)$/d;p}'
    else
        timeout --foreground -k 5 "$timeout" "${qemu[@]}" </dev/null 2>&1 | sed -u -e 's/\r$//'
    fi
    qrc=${PIPESTATUS[0]}
fi
ms=$((($(date +%s%N) - t0) / 1000000))
wall=$(printf "%d.%01d" $((ms / 1000)) $((ms % 1000 / 100)))

if ((qrc == 124 || qrc == 137)); then
    rc=124
    say "TIMEOUT after ${timeout}s: the guest was killed (console log: $jobdir/console.log)"
elif [[ -f "$jobdir/setup_failed" ]]; then
    rc=123
    say "GUEST SETUP FAILED: $(cat "$jobdir/setup_failed") (console log: $jobdir/console.log)"
elif [[ -s "$jobdir/exit_code" ]]; then
    rc=$(tr -dc '0-9' <"$jobdir/exit_code")
elif grep -aq '^SOFTROCE_EXIT=' "$jobdir/console.log" 2>/dev/null; then
    rc=$(grep -a '^SOFTROCE_EXIT=' "$jobdir/console.log" | tail -1 | tr -dc '0-9')
else
    rc=125
    say "the guest reported no exit status (qemu exit $qrc; kernel panic or crash?); console log: $jobdir/console.log"
    tail -n 20 "$jobdir/console.log" 2>/dev/null | sed 's/\r$//' >&2
fi
rc=${rc:-125}
((quiet)) || say "job exit status $rc, ${wall}s wall"
if ((keep || (rc != 0 && !shell))); then
    ((quiet)) || say "kept job dir $jobdir"
else
    rm -rf "$jobdir"
fi
exit "$rc"
