"""The opt-in switch: with PAGEWIRE_AS_MOONCAKE=1, `import mooncake.engine` gives
pagewire.mooncake_compat, `import mooncake.store` pagewire.mooncake_store and
`import mooncake.buffer_pool` pagewire.mooncake_buffer_pool, through the .pth file the
installed wheel puts in site-packages, and every other `mooncake.*` fails naming itself. Each check runs in a fresh interpreter."""

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
        "print(e is c, TransferEngine.__module__, getattr(mooncake, '__file__', None))",
        {"PAGEWIRE_AS_MOONCAKE": "1"},
    )
    same, module, mooncake_file = out.split()
    assert same == "True" and module == "pagewire.mooncake_compat"
    # the package is pagewire's placeholder even though Mooncake's wheel is installed
    assert mooncake_file == "None"


def test_switch_on_redirects_mooncake_store():
    """SGLang's HiCache import, unchanged: `from mooncake.store import ...`."""
    out = py(
        "import mooncake.store as s, pagewire.mooncake_store as p, pagewire.mooncake_compat as c;"
        "from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction;"
        "print(s is p, MooncakeDistributedStore is c.MooncakeDistributedStore,"
        " MooncakeDistributedStore.__module__, ReplicateConfig().replica_num)",
        {"PAGEWIRE_AS_MOONCAKE": "1"},
    )
    assert out.split() == ["True", "True", "pagewire._mooncake_store", "1"]


def test_switch_on_redirects_mooncake_buffer_pool():
    out = py(
        "import mooncake.buffer_pool as b, pagewire.mooncake_buffer_pool as p, mooncake.store as s;"
        "from mooncake.buffer_pool import BufferPool, RegisteredBufferPool;"
        "print(b is p, BufferPool is RegisteredBufferPool is s.BufferPool, sorted(b.__all__))",
        {"PAGEWIRE_AS_MOONCAKE": "1"},
    )
    assert out == "True True ['BufferPool', 'RegisteredBufferPool']"
    # The package exports them too, as Mooncake's mooncake/__init__.py does.
    out = py(
        "import mooncake, mooncake.store as s; from mooncake import BufferPool, RegisteredBufferPool;"
        "print(BufferPool is RegisteredBufferPool is s.BufferPool, mooncake.__all__)",
        {"PAGEWIRE_AS_MOONCAKE": "1"},
    )
    assert out == "True ['BufferPool', 'RegisteredBufferPool']"


def test_switch_on_refuses_what_pagewire_does_not_provide():
    """Never a mix of the two: other Mooncake modules and names fail at the import, named."""
    code = r"""
import importlib
for mod in ("mooncake.async_store", "mooncake.shared_segment", "mooncake.mooncake_connector_v1"):
    try:
        importlib.import_module(mod)
    except ImportError as e:
        assert mod in str(e) and "pagewire does not provide" in str(e), e
        assert e.name == mod
    else:
        raise SystemExit(f"{mod} imported")
# A name the module lacks: `from` imports fail naming it and pagewire's module (Python
# words that ImportError itself); attribute access says why, and hasattr stays False.
import mooncake, mooncake.store
try:
    from mooncake.store import NotInTheWheel
except ImportError as e:
    assert "NotInTheWheel" in str(e) and "pagewire.mooncake_store" in str(e), e
else:
    raise SystemExit("NotInTheWheel imported")
# pagewire.mooncake_store has every name of the wheel's module (test_mooncake_surface.py);
# a name neither has is refused by name, as is any name of the placeholder package.
for mod, attr, name in ((mooncake.store, "NotInTheWheel", "mooncake.store.NotInTheWheel"),
                        (mooncake, "TransferEngine", "mooncake.TransferEngine")):
    try:
        getattr(mod, attr)
    except AttributeError as e:
        assert f"pagewire does not provide {name}" in str(e), e
    assert not hasattr(mod, attr)
print("refused")
"""
    assert py(code, {"PAGEWIRE_AS_MOONCAKE": "1"}) == "refused"


def test_switch_off_leaves_the_real_mooncake():
    for value in (None, "0", ""):
        env = {} if value is None else {"PAGEWIRE_AS_MOONCAKE": value}
        out = py("import mooncake.engine as e, mooncake.store as s; print(e.__file__, s.__file__)", env)
        engine, store = out.split()
        assert engine.endswith("engine.so") and store.endswith("store.so"), out


def test_without_the_real_mooncake(tmp_path):
    """A site directory with only the installed pagewire files (no Mooncake at all): the
    hook provides an empty `mooncake` package so that `mooncake.engine` resolves."""
    for name in ("pagewire", "_pagewire_mooncake_hook.py", "pagewire_mooncake.pth"):
        src = SITE / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]);"
        "import mooncake.engine as e; import mooncake; import mooncake.store as s;"
        "print(e.__name__, e.TransferEngine.__module__, s.__name__, mooncake.__path__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PAGEWIRE_AS_MOONCAKE"}
    env["PAGEWIRE_AS_MOONCAKE"] = "1"
    # -S: no site-packages of this venv (so no real Mooncake); -I keeps PYTHONPATH out.
    p = subprocess.run(
        [sys.executable, "-S", "-I", "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # `mooncake.engine` is the very module object pagewire.mooncake_compat, and
    # `mooncake.store` pagewire.mooncake_store
    assert p.stdout.split()[:3] == ["pagewire.mooncake_compat", "pagewire.mooncake_compat", "pagewire.mooncake_store"]
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
