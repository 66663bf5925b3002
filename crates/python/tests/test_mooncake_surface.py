"""Every public name of Mooncake's wheel (mooncake-transfer-engine-non-cuda 0.3.13.post1)
exists in pagewire with the same signature: ``mooncake.store`` against
``pagewire.mooncake_store``, ``mooncake.engine`` against ``pagewire.mooncake_compat`` and
``mooncake.buffer_pool`` against ``pagewire.mooncake_buffer_pool`` (what
``PAGEWIRE_AS_MOONCAKE=1`` answers for them).

The wheel's surface is read in a separate process (mooncake_surface.py): classes, their
methods, properties (a writable one must be settable in pagewire too) and nested enums, module-level functions, enums with their members
and values, and constants. pybind11 callables carry their signatures in the docstring
(one line per overload); pagewire's are read with ``inspect.signature`` (Python functions,
and pyo3 ones through ``__text_signature__``). Same signature means: the same parameter
names in the same order (pybind11's ``argN`` is positional only: any name), the same
kinds (positional, ``*args``, keyword-only, ``**kwargs``), a default exactly where
Mooncake has one, and the same default value (a default-constructed object such as
``ReplicateConfig()`` is matched by ``None`` or an instance of that class). An
overloaded callable must match its longest overload and accept the others' positional
calls, so it may give defaults that the longest overload lacks.

One test id per name (``store:...``, ``engine:...``, ``buffer_pool:...``); the names in
``DIFFERENCES`` are checked for presence only, each with its reason, and docs/python.md lists each of
them. Without the wheel this fails; it never skips.
"""

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PAGEWIRE_MODULES = {
    "store": "pagewire.mooncake_store",
    "engine": "pagewire.mooncake_compat",
    "buffer_pool": "pagewire.mooncake_buffer_pool",
}

#: Names whose signature pagewire cannot or does not match; presence is still checked.
DIFFERENCES = {
    "store:MooncakeDistributedStore.load_tensor_from_safetensor": (
        "Mooncake's binding gives `key` a default before the required `file_name`, which a "
        "Python signature cannot express: pagewire's is (key=None, file_name='')"
    ),
}


def _wheel_surface():
    r = subprocess.run(
        [sys.executable, str(HERE / "mooncake_surface.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    if r.returncode != 0:
        return None, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), ""


SURFACE, SURFACE_ERROR = _wheel_surface()
NAMES = sorted(SURFACE) if SURFACE else ["wheel-missing"]


def _pagewire_object(name: str):
    """pagewire's object for a surface name, or raise AssertionError naming what lacks."""
    short, _, dotted = name.partition(":")
    mod = importlib.import_module(PAGEWIRE_MODULES[short])
    parts = dotted.split(".")
    obj = mod
    owner = None
    for i, p in enumerate(parts):
        owner = obj
        if isinstance(obj, type) and p in _slots(obj):
            return owner, None
        try:
            obj = getattr(obj, p)
        except AttributeError:
            where = PAGEWIRE_MODULES[short] + "".join("." + q for q in parts[:i])
            raise AssertionError(f"pagewire lacks {name} ({where} has no {p!r})") from None
    return owner, obj


def _slots(cls) -> set:
    out = set()
    for c in cls.__mro__:
        s = c.__dict__.get("__slots__", ())
        out.update([s] if isinstance(s, str) else s)
    return out


def _params(sig: inspect.Signature, drop_self: bool) -> list:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "pos",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
        inspect.Parameter.VAR_POSITIONAL: "var",
        inspect.Parameter.KEYWORD_ONLY: "kw",
        inspect.Parameter.VAR_KEYWORD: "varkw",
    }
    ps = list(sig.parameters.values())
    if drop_self and ps and ps[0].name in ("self", "cls"):
        ps = ps[1:]
    return [(p.name, kinds[p.kind], p.kind, p.default) for p in ps]


def _default_matches(want, got) -> bool:
    tag = want[0]
    if tag == "instance":
        return got is None or type(got).__name__ == want[1]
    if tag == "enum":
        return getattr(got, "name", None) == want[1] and int(got) == want[2]
    if tag == "lit":
        return type(got) is type(want[1]) and got == want[1]
    return False


def _compare(want: list, got: list, allow_extra_defaults: bool) -> list:
    """The differences between a wheel overload and pagewire's parameters, as text."""
    errs = []
    if len(want) != len(got):
        errs.append(f"{len(got)} parameters, Mooncake has {len(want)}")
    for w, g in zip(want, got):
        wname, wkind, wdef = w
        gname, gkind, graw, gdef = g
        positional_only = wname.startswith("arg") and wname[3:].isdigit()
        if not positional_only and wname != gname:
            errs.append(f"parameter {gname!r} where Mooncake has {wname!r}")
        if positional_only and graw == inspect.Parameter.KEYWORD_ONLY:
            errs.append(f"{gname!r} is keyword-only, Mooncake's {wname} is positional")
        elif wkind != gkind:
            errs.append(f"{gname!r} is {gkind}, Mooncake's {wname!r} is {wkind}")
        has = gdef is not inspect.Parameter.empty
        if wdef is None:
            if has and not allow_extra_defaults:
                errs.append(f"{gname!r} has default {gdef!r}, required in Mooncake")
        elif not has:
            errs.append(f"{gname!r} is required, Mooncake's default is {wdef[1:]}")
        elif not _default_matches(wdef, gdef):
            errs.append(f"{gname!r} defaults to {gdef!r}, Mooncake's to {wdef[1:]}")
    return errs


def _check_callable(name: str, entry: dict, owner, obj) -> None:
    assert callable(obj), f"{name}: pagewire's is not callable ({type(obj).__name__})"
    kind = entry["kind"]
    raw = owner.__dict__.get(name.rsplit(".", 1)[-1]) if isinstance(owner, type) else None
    if kind == "staticmethod":
        assert isinstance(raw, staticmethod) or inspect.isbuiltin(obj), f"{name}: not static"
    drop_self = kind == "method"
    try:
        if isinstance(owner, type) and obj is object.__init__:
            # A native class constructed by `__new__` alone: its signature is the class's.
            sig, drop_self = inspect.signature(owner), False
        else:
            sig = inspect.signature(raw.__func__ if isinstance(raw, staticmethod) else obj)
    except (TypeError, ValueError) as e:
        pytest.fail(f"{name}: pagewire's callable has no signature to compare ({e})")
    if isinstance(obj, type):  # a class's __init__ read through the class
        drop_self = False
    got = _params(sig, drop_self)
    overloads = entry["overloads"]
    assert overloads, f"{name}: Mooncake's docstring gave no signature"
    longest = max(overloads, key=len)
    errs = _compare(longest, got, allow_extra_defaults=len(overloads) > 1)
    assert not errs, f"{name}: " + "; ".join(errs)
    for other in overloads:
        if other is longest:
            continue
        args = [object()] * sum(1 for p in other if p[1] == "pos" and p[2] is None)
        try:
            sig.bind(*([None] if drop_self else []), *args)
        except TypeError as e:
            pytest.fail(f"{name}: does not accept Mooncake's overload {other} ({e})")


@pytest.mark.parametrize("name", NAMES)
def test_name(name):
    if SURFACE is None:
        pytest.fail(
            "the Mooncake wheel's surface could not be read (pip install "
            "mooncake-transfer-engine-non-cuda==0.3.13.post1; scripts/python-test.sh does):\n"
            + SURFACE_ERROR
        )
    entry = SURFACE[name]
    owner, obj = _pagewire_object(name)
    if name in DIFFERENCES:
        return
    kind = entry["kind"]
    if obj is None:  # a __slots__ field: an attribute, as a property is
        assert kind == "property", f"{name}: pagewire has a data field, Mooncake a {kind}"
        return
    if kind == "property" and entry.get("writable"):
        raw = inspect.getattr_static(owner, name.rsplit(".", 1)[-1])
        assert not isinstance(raw, property) or raw.fset is not None, f"{name}: read-only, Mooncake's is writable"
    if kind == "class":
        assert isinstance(obj, type), f"{name}: pagewire's is a {type(obj).__name__}"
    elif kind == "enum":
        assert isinstance(obj, type), f"{name}: pagewire's is a {type(obj).__name__}"
        for m, v in entry["members"].items():
            assert hasattr(obj, m), f"{name}: pagewire lacks member {m}"
            assert int(getattr(obj, m)) == v, f"{name}.{m} = {int(getattr(obj, m))}, Mooncake's {v}"
    elif kind == "enum_value":
        assert getattr(obj, "name", None) == name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        assert type(obj).__name__ == entry["enum"], f"{name}: of {type(obj).__name__}"
        assert int(obj) == entry["value"], f"{name} = {int(obj)}, Mooncake's {entry['value']}"
    elif kind == "value":
        assert obj == entry["value"], f"{name} = {obj!r}, Mooncake's {entry['value']!r}"
    elif kind != "property":  # a property: being there is all a caller can see
        if name.endswith(".__init__"):
            obj = owner.__init__
        _check_callable(name, entry, owner, obj)


def test_differences_are_documented():
    text = (REPO / "docs" / "python.md").read_text()
    missing = [n for n in DIFFERENCES if f"`{n}`" not in text]
    assert not missing, f"docs/python.md does not list: {missing}"


def test_differences_are_wheel_names():
    assert SURFACE is not None, SURFACE_ERROR
    stale = [n for n in DIFFERENCES if n not in SURFACE]
    assert not stale, f"no longer in Mooncake's wheel: {stale}"
