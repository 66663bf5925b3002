#!/usr/bin/env python3
"""Helpers for the soft-RoCE guest image and the cargo-test wrapper.

Subcommands:
  vmlinux BZIMAGE OUT          extract the xz-compressed ELF kernel from a bzImage (PVH boot)
  modclosure MODDIR NAME...    print the modules NAME... need, dependencies first, as
                               paths relative to MODDIR (reads .modinfo "depends=")
  cpio STAGEDIR OUT            write STAGEDIR as an uncompressed newc cpio (root-owned,
                               plus /dev/console), deterministic order and mtimes
  cargo-tests                  read `cargo test --no-run --message-format=json` on stdin,
                               print "NAME<TAB>EXECUTABLE<TAB>PACKAGE_DIR" per test binary
"""

import json
import lzma
import os
import stat
import struct
import sys

XZ_MAGIC = b"\xfd7zXZ\x00"


def cmd_vmlinux(bzimage, out):
    data = open(bzimage, "rb").read()
    pos = data.find(XZ_MAGIC)
    while pos >= 0:
        try:
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[pos:])
        except lzma.LZMAError:
            elf = b""
        if elf.startswith(b"\x7fELF"):
            tmp = out + ".tmp"
            with open(tmp, "wb") as f:
                f.write(elf)
            os.replace(tmp, out)
            return 0
        pos = data.find(XZ_MAGIC, pos + 1)
    sys.exit(f"imagetool: no xz-compressed ELF found in {bzimage}")


def norm(name):
    # Module file names mix '-' and '_' (crc32-pclmul.ko); the kernel treats them as equal.
    return name.replace("-", "_")


def modinfo_depends(path):
    """The 'depends=' list from the .modinfo section of an ELF64 .ko file."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        sys.exit(f"imagetool: {path} is not an uncompressed ELF64 module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        name, _typ, _flags, _addr, off, size = struct.unpack_from(
            "<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name:end] == b".modinfo":
            for field in data[off:off + size].split(b"\0"):
                if field.startswith(b"depends="):
                    deps = field[len(b"depends="):].decode()
                    return [norm(d) for d in deps.split(",") if d]
            return []
    return []


def cmd_modclosure(moddir, names):
    index = {}
    for root, _dirs, files in os.walk(moddir):
        for f in files:
            if f.endswith(".ko"):
                index[norm(f[:-3])] = os.path.relpath(os.path.join(root, f), moddir)
    order, seen = [], set()

    def visit(name, chain):
        name = norm(name)
        if name in seen:
            return
        if name not in index:
            sys.exit(f"imagetool: module {name} not found under {moddir} (needed by {chain})")
        seen.add(name)
        for dep in modinfo_depends(os.path.join(moddir, index[name])):
            visit(dep, chain + [name])
        order.append(index[name])

    for n in names:
        visit(n, [])
    print("\n".join(order))
    return 0


def cmd_cpio(stagedir, out):
    entries = []
    for root, dirs, files in os.walk(stagedir):
        dirs.sort()
        for n in sorted(dirs) + sorted(files):
            full = os.path.join(root, n)
            entries.append((os.path.relpath(full, stagedir), full))
    entries.sort()
    ino = 1
    with open(out + ".tmp", "wb") as f:

        def emit(name, mode, body=b"", rdev=(0, 0)):
            nonlocal ino
            nb = name.encode() + b"\0"
            hdr = "070701" + "".join("%08X" % v for v in (
                ino, mode, 0, 0, 1, 0, len(body), 0, 0, rdev[0], rdev[1], len(nb), 0))
            ino += 1
            f.write(hdr.encode() + nb)
            f.write(b"\0" * (-(110 + len(nb)) % 4))
            f.write(body)
            f.write(b"\0" * (-len(body) % 4))

        for rel, full in entries:
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                emit(rel, stat.S_IFLNK | 0o777, os.readlink(full).encode())
            elif stat.S_ISDIR(st.st_mode):
                emit(rel, stat.S_IFDIR | 0o755)
            elif stat.S_ISREG(st.st_mode):
                perm = 0o755 if st.st_mode & 0o111 else 0o644
                emit(rel, stat.S_IFREG | perm, open(full, "rb").read())
        emit("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
        emit("TRAILER!!!", 0)
    os.replace(out + ".tmp", out)
    return 0


def package_name(pkg_id):
    # "path+file:///w/crates/x#name@0.1.0", "path+file:///w/crates/name#0.1.0" or the
    # older "name 0.1.0 (path+file:///...)".
    if "#" in pkg_id:
        frag = pkg_id.rsplit("#", 1)[1]
        if "@" in frag:
            return frag.split("@", 1)[0]
        return pkg_id.rsplit("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return pkg_id.split(" ", 1)[0] or "?"


def cmd_cargo_tests():
    seen = set()
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") != "compiler-artifact":
            continue
        exe = msg.get("executable")
        if not exe or not msg.get("profile", {}).get("test") or exe in seen:
            continue
        seen.add(exe)
        kinds = msg.get("target", {}).get("kind", [])
        name = msg.get("target", {}).get("name", "?")
        label = f"{package_name(msg.get('package_id', ''))}::{name} ({'/'.join(kinds)})"
        pkgdir = os.path.dirname(msg.get("manifest_path", ""))
        print(f"{label}\t{exe}\t{pkgdir}")
    return 0


def main(argv):
    if len(argv) >= 3 and argv[0] == "vmlinux":
        return cmd_vmlinux(argv[1], argv[2])
    if len(argv) >= 2 and argv[0] == "modclosure":
        return cmd_modclosure(argv[1], argv[2:])
    if len(argv) == 3 and argv[0] == "cpio":
        return cmd_cpio(argv[1], argv[2])
    if argv == ["cargo-tests"]:
        return cmd_cargo_tests()
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
