"""The opt-in switch: with PAGEWIRE_AS_MOONCAKE=1, `import mooncake.engine` gives
pagewire.mooncake_compat, through the .pth file the installed wheel puts in
site-packages. Each check runs in a fresh interpreter."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pagewire

SITE = Path(sysconfig.get_paths()["purelib"])


def py(code, env_extra=None, args=()):
    env = {k: v for k, v in os.environ.items() if k != "PAGEWIRE_AS_MOONCAKE"}
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip()


def test_wheel_installed_the_pth_and_no_mooncake_package():
    assert (SITE / "pagewire_mooncake.pth").is_file()
    assert (SITE / "_pagewire_mooncake_hook.py").is_file()
    # The pagewire wheel owns no mooncake/ directory: its RECORD lists none.
    record = next(SITE.glob("pagewire-*.dist-info")) / "RECORD"
    assert not [l for l in record.read_text().splitlines() if l.startswith("mooncake")]
    assert Path(pagewire.__file__).parent.parent == SITE


def test_switch_on_redirects_mooncake_engine():
    out = py(
        "import mooncake.engine as e, pagewire.mooncake_compat as c, mooncake;"
        "from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify;"
        "print(e is c, TransferEngine.__module__, mooncake.__file__)",
        {"PAGEWIRE_AS_MOONCAKE": "1"},
    )
    same, module, mooncake_file = out.split()
    assert same == "True" and module == "pagewire.mooncake_compat"
    # the real Mooncake package stays installed and importable around it
    assert mooncake_file.endswith("mooncake/__init__.py")


def test_switch_off_leaves_the_real_mooncake():
    for value in (None, "0", ""):
        env = {} if value is None else {"PAGEWIRE_AS_MOONCAKE": value}
        out = py("import mooncake.engine as e; print(e.__file__)", env)
        assert out.endswith("engine.so"), out


def test_without_the_real_mooncake(tmp_path):
    """A site directory with only the installed pagewire files (no Mooncake at all): the
    hook provides an empty `mooncake` package so that `mooncake.engine` resolves."""
    for name in ("pagewire", "_pagewire_mooncake_hook.py", "pagewire_mooncake.pth"):
        src = SITE / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]);"
        "import mooncake.engine as e; import mooncake;"
        "print(e.__name__, e.TransferEngine.__module__, mooncake.__path__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PAGEWIRE_AS_MOONCAKE"}
    env["PAGEWIRE_AS_MOONCAKE"] = "1"
    # -S: no site-packages of this venv (so no real Mooncake); -I keeps PYTHONPATH out.
    p = subprocess.run(
        [sys.executable, "-S", "-I", "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # `mooncake.engine` is the very module object pagewire.mooncake_compat
    assert p.stdout.split()[:2] == ["pagewire.mooncake_compat", "pagewire.mooncake_compat"]
    # and without the switch, there is no mooncake at all
    env.pop("PAGEWIRE_AS_MOONCAKE")
    p = subprocess.run(
        [sys.executable, "-S", "-I", "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode != 0 and "No module named 'mooncake'" in p.stderr


def test_unchanged_caller_code_moves_bytes_through_the_hook():
    """SGLang's call sequence, written against `mooncake.engine`, on pagewire."""
    code = r"""
import ctypes
from mooncake.engine import TransferEngine
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
src = ctypes.create_string_buffer(b"kv" * 32768, 65536)
dst = ctypes.create_string_buffer(65536)
assert a.batch_register_memory([ctypes.addressof(src)], [65536]) == 0
assert b.batch_register_memory([ctypes.addressof(dst)], [65536]) == 0
sid = f"127.0.0.1:{b.get_rpc_port()}"
rc = a.batch_transfer_sync_write(sid, [ctypes.addressof(src)], [ctypes.addressof(dst)], [65536])
print(rc, dst.raw == src.raw, type(a).__module__)
"""
    out = py(code, {"PAGEWIRE_AS_MOONCAKE": "1"})
    assert out == "0 True pagewire.mooncake_compat"


def test_hook_module_in_process():
    import _pagewire_mooncake_hook as hook

    hook.install()
    hook.install()
    assert sum(isinstance(f, hook.MooncakeFinder) for f in sys.meta_path) == 1
    hook.uninstall()
    assert not any(isinstance(f, hook.MooncakeFinder) for f in sys.meta_path)
    assert site  # the .pth is processed by `site` at start-up
