"""The public surface of Mooncake's wheel (``mooncake.store``, ``mooncake.engine``,
``mooncake.buffer_pool``), as data: ``python mooncake_surface.py`` prints one JSON
object, name -> entry. Run in its own process by test_mooncake_surface.py so that the
test process never loads the wheel.

Names are ``store:X`` (module level) and ``store:X.y`` (class member). An entry has a
``kind``: ``class``, ``enum`` (with ``members``: name -> int), ``enum_value`` (``enum``
and ``value``), ``value`` (a plain constant, ``value``), ``property``, ``function``,
``method`` or ``staticmethod`` (with ``overloads``: the parameter lists pybind11 writes
in the docstring, ``self`` left out). A parameter is ``[name, kind, default]``: kind is
``pos`` (positional or keyword), ``var`` (``*args``), ``kw`` (keyword-only) or ``varkw``;
default is ``None`` (required), ``["lit", value]``, ``["instance", class name]`` or
``["enum", name, int]``.
"""

import ast
import importlib
import json
import re

MODULES = {"store": "mooncake.store", "engine": "mooncake.engine", "buffer_pool": "mooncake.buffer_pool"}

_SIG = re.compile(r"^(?:\d+\.\s+)?(\w+)\((.*)\)(?:\s*->.*)?$")
_INSTANCE = re.compile(r"^<([\w.]+) object at 0x[0-9a-f]+>$")
_ENUM = re.compile(r"^<([\w.]+)\.(\w+): (-?\d+)>$")


def split_top(text: str) -> list:
    """``text`` split on the commas that are outside brackets and quotes."""
    out, depth, cur, quote = [], 0, [], None
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_default(text: str):
    text = text.strip()
    m = _INSTANCE.match(text)
    if m:
        return ["instance", m.group(1).rsplit(".", 1)[-1]]
    m = _ENUM.match(text)
    if m:
        return ["enum", m.group(2), int(m.group(3))]
    try:
        return ["lit", ast.literal_eval(text)]
    except (ValueError, SyntaxError):
        return ["raw", text]


def parse_params(text: str) -> list:
    """pybind11's ``a: int, b: str = 'x', *args, c: X = ...`` as ``[name, kind, default]``."""
    params, kw = [], False
    for part in split_top(text):
        head, eq, default = part.partition("=")
        name = head.split(":", 1)[0].strip()
        if name.startswith("**"):
            params.append([name[2:], "varkw", None])
        elif name == "*":
            kw = True
        elif name.startswith("*"):
            params.append([name[1:], "var", None])
            kw = True
        elif name != "/":
            params.append([name, "kw" if kw else "pos", parse_default(default) if eq else None])
    return params


def overloads(func, name: str, drop_self: bool) -> list:
    """The parameter lists in a pybind11 callable's docstring (one per overload)."""
    found = []
    lines = [x.strip() for x in (getattr(func, "__doc__", None) or "").splitlines()]
    numbered = [x for x in lines if re.match(r"^\d+\.\s", x)]
    for line in numbered or lines:  # an overloaded one's first line is name(*args, **kwargs)
        m = _SIG.match(line)
        if m and m.group(1) == name:
            params = parse_params(m.group(2))
            if drop_self and params and params[0][0] == "self":
                params = params[1:]
            found.append(params)
    return found


def is_enum(cls) -> bool:
    return isinstance(cls, type) and isinstance(getattr(cls, "__members__", None), dict)


def enum_members(cls) -> dict:
    return {n: int(v) for n, v in cls.__members__.items()}


def member_entry(cls, name: str):
    raw = cls.__dict__[name]
    if isinstance(raw, property):
        return {"kind": "property", "writable": raw.fset is not None}
    if isinstance(raw, staticmethod):
        f = getattr(cls, name)
        return {"kind": "staticmethod", "overloads": overloads(f, name, False)}
    if isinstance(raw, type):
        if is_enum(raw):
            return {"kind": "enum", "members": enum_members(raw)}
        return {"kind": "class"}
    if callable(raw):
        if name == "__init__" and type(raw).__name__ == "wrapper_descriptor":
            return None  # no constructor bound: nothing to match
        ov = overloads(raw, name, True)
        if not ov:  # a builtin staticmethod reads as a plain function in __dict__
            return None
        return {"kind": "method", "overloads": ov}
    if is_enum(cls) and name in cls.__members__:
        return None  # listed in the enum's members
    return {"kind": "value", "value": raw if isinstance(raw, (bool, int, float, str)) else repr(raw)}


def surface(short: str, modname: str) -> dict:
    mod = importlib.import_module(modname)
    out = {}
    for name in sorted(dir(mod)):
        if name.startswith("_"):
            continue
        obj = getattr(mod, name)
        key = f"{short}:{name}"
        if is_enum(obj):
            out[key] = {"kind": "enum", "members": enum_members(obj)}
            continue
        if isinstance(obj, type):
            out[key] = {"kind": "class"}
            for m in sorted(vars(obj)):
                if m.startswith("_") and m != "__init__":
                    continue
                if is_enum(obj) and m in ("name", "value", "__init__"):
                    continue
                e = member_entry(obj, m)
                if e is not None:
                    out[f"{key}.{m}"] = e
            continue
        if is_enum(type(obj)):
            out[key] = {"kind": "enum_value", "enum": type(obj).__name__, "value": int(obj)}
        elif callable(obj):
            out[key] = {"kind": "function", "overloads": overloads(obj, name, False)}
        elif isinstance(obj, (bool, int, float, str)):
            out[key] = {"kind": "value", "value": obj}
        # Submodules and other objects are not part of the surface compared here.
    return out


def main() -> None:
    out = {}
    for short, modname in MODULES.items():
        out.update(surface(short, modname))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
