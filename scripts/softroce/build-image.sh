#!/usr/bin/env bash
# Build (or reuse) the soft-RoCE guest image: Debian's kernel as an uncompressed vmlinux
# (PVH boot) and a busybox initramfs holding the guest init and the modules rxe needs.
#
# Debian's kernel package is downloaded and unpacked, never installed. The image is cached
# in $SOFTROCE_CACHE/image and rebuilt only when an input changes: the kernel package name
# and version, the module list, the guest init, this script, imagetool.py, busybox.
#
# Environment:
#   SOFTROCE_CACHE        cache directory (default: <repo>/.softroce)
#   SOFTROCE_KERNEL_PKG   kernel package to use (default: what linux-image-amd64 depends on)
# Prints the image directory on stdout; progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${SOFTROCE_CACHE:-$repo/.softroce}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
img="$cache/image"

# Modules asked for; their dependencies come from each module's .modinfo. crc32_generic is
# not a dependency of rdma_rxe, yet rxe's ICRC needs the "crc32" crypto transform.
MODULES=(virtio_pci virtio_net 9pnet_virtio 9p overlay dummy veth
         crc32_generic crc32_pclmul ib_uverbs rdma_ucm rdma_rxe)

log() { echo "softroce-image: $*" >&2; }

resolve_pkg() {
    if [[ -n "${SOFTROCE_KERNEL_PKG:-}" ]]; then
        echo "$SOFTROCE_KERNEL_PKG"
        return
    fi
    apt-cache depends linux-image-amd64 2>/dev/null |
        awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'
}

# apt-cache costs about 1 s per call here; its answer only changes with the package lists,
# so it is remembered under a key made of their newest mtime.
aptkey="${SOFTROCE_KERNEL_PKG:-default} $(stat -c %Y /var/lib/apt/lists /var/lib/apt/lists/*_Packages* 2>/dev/null | sort -n | tail -1)"
pkg="" ver=""
if [[ -f "$cache/resolved" ]] && [[ "$(head -1 "$cache/resolved")" == "$aptkey" ]]; then
    read -r pkg ver < <(sed -n 2p "$cache/resolved")
else
    pkg="$(resolve_pkg)"
    if [[ -z "$pkg" && ! -f "$img/stamp" && "$(id -u)" == 0 ]]; then
        # A fresh machine may have empty package lists (setup.sh skips `apt-get update`
        # when every package is already installed).
        log "no apt metadata for linux-image-amd64; running apt-get update"
        apt-get update -qq >&2 || true
        pkg="$(resolve_pkg)"
        aptkey="${SOFTROCE_KERNEL_PKG:-default} $(stat -c %Y /var/lib/apt/lists /var/lib/apt/lists/*_Packages* 2>/dev/null | sort -n | tail -1)"
    fi
    if [[ -n "$pkg" ]]; then
        ver="$(apt-cache show --no-all-versions "$pkg" 2>/dev/null | awk '$1 == "Version:" { print $2; exit }')"
    fi
    [[ -n "$pkg" && -n "$ver" ]] && printf '%s\n%s %s\n' "$aptkey" "$pkg" "$ver" > "$cache/resolved"
fi
if [[ -z "$pkg" || -z "$ver" ]]; then
    # No apt metadata (offline?): an existing image is better than nothing.
    if [[ -f "$img/stamp" ]]; then
        log "cannot resolve the kernel package via apt; reusing the cached image ($(cat "$img/kpkg" 2>/dev/null))"
        echo "$img"
        exit 0
    fi
    log "cannot resolve a kernel package (set SOFTROCE_KERNEL_PKG, run apt-get update)"
    exit 1
fi

stamp="$( {
    echo "pkg=$pkg ver=$ver modules=${MODULES[*]}"
    busybox 2>&1 | head -1
    cat "$here/init" "$here/imagetool.py" "$0"
} | sha256sum | cut -c1-16)"

if [[ -f "$img/stamp" && "$(cat "$img/stamp")" == "$stamp" && -f "$img/vmlinux" && -f "$img/initramfs.cpio" ]]; then
    echo "$img"
    exit 0
fi

# One builder at a time; a concurrent run waits and then finds the image ready.
exec 9>"$cache/build.lock"
flock 9
if [[ -f "$img/stamp" && "$(cat "$img/stamp")" == "$stamp" ]]; then
    echo "$img"
    exit 0
fi

t0=$SECONDS
log "building image for $pkg $ver (stamp $stamp)"
for tool in dpkg-deb apt-get busybox python3 cpio; do
    [[ "$tool" == cpio ]] && continue # written by imagetool.py
    command -v "$tool" >/dev/null || { log "missing tool: $tool (run scripts/setup.sh --vm)"; exit 1; }
done

debdir="$cache/debs"
mkdir -p "$debdir"
deb="$(ls "$debdir/${pkg}_${ver//:/%3a}_"*.deb 2>/dev/null | head -1 || true)"
if [[ -z "$deb" ]]; then
    log "downloading $pkg=$ver"
    # apt's sandbox user may not write here; the download then runs as the caller (warning only).
    (cd "$debdir" && apt-get download -q "$pkg=$ver" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2) || true
    deb="$(ls "$debdir/${pkg}_"*.deb 2>/dev/null | head -1 || true)"
    [[ -n "$deb" ]] || { log "download of $pkg failed"; exit 1; }
fi

work="$(mktemp -d "$cache/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log "unpacking $(basename "$deb")"
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work" --wildcards './boot/vmlinuz-*' './lib/modules/*'
kver="$(ls "$work/lib/modules" | head -1)"
moddir="$work/lib/modules/$kver"

new="$work/image"
mkdir -p "$new"
cp "$work/boot/vmlinuz-$kver" "$new/vmlinuz"
python3 "$here/imagetool.py" vmlinux "$new/vmlinuz" "$new/vmlinux"

stage="$work/stage"
mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,run,tmp,etc,lower,ovl,host,lib/modules/"$kver"}
cp /bin/busybox "$stage/bin/busybox" 2>/dev/null || cp "$(command -v busybox)" "$stage/bin/busybox"
file -L "$stage/bin/busybox" 2>/dev/null | grep -q 'statically linked' ||
    ldd "$stage/bin/busybox" 2>&1 | grep -q 'not a dynamic' ||
    { log "busybox is not static (install busybox-static)"; exit 1; }
# Applet links at their usual paths, so /sbin/modprobe exists for the kernel's request_module.
"$stage/bin/busybox" --list-full | while read -r applet; do
    [[ -e "$stage/$applet" || -L "$stage/$applet" ]] || ln -s /bin/busybox "$stage/$applet"
done
cp "$here/init" "$stage/init"
chmod 755 "$stage/init"

python3 "$here/imagetool.py" modclosure "$moddir" "${MODULES[@]}" > "$work/modlist"
while read -r rel; do
    mkdir -p "$stage/lib/modules/$kver/$(dirname "$rel")"
    cp "$moddir/$rel" "$stage/lib/modules/$kver/$rel"
done < "$work/modlist"
cp "$moddir/modules.builtin" "$moddir/modules.order" "$stage/lib/modules/$kver/" 2>/dev/null || true
# The .deb ships no modules.dep (its postinst makes one); busybox depmod is enough.
"$stage/bin/busybox" depmod -b "$stage" "$kver"
[[ -s "$stage/lib/modules/$kver/modules.dep" ]] || { log "depmod wrote no modules.dep"; exit 1; }
python3 "$here/imagetool.py" cpio "$stage" "$new/initramfs.cpio"

echo "$kver" > "$new/kver"
echo "$pkg $ver" > "$new/kpkg"
cp "$work/modlist" "$new/modules.txt"
echo "$stamp" > "$new/stamp"
rm -rf "$img.old"
[[ -d "$img" ]] && mv "$img" "$img.old"
mv "$new" "$img"
rm -rf "$img.old"
# Keep only the .deb in use.
find "$debdir" -name '*.deb' ! -name "$(basename "$deb")" -delete
log "image ready in $((SECONDS - t0)) s: $img ($(wc -l < "$img/modules.txt") modules, kernel $kver, initramfs $(($(stat -c %s "$img/initramfs.cpio") / 1024)) KiB)"
echo "$img"
