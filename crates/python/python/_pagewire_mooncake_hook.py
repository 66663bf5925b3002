"""Opt-in import hook: with ``PAGEWIRE_AS_MOONCAKE=1``, the ``mooncake`` package is
pagewire's: ``import mooncake.engine`` gives ``pagewire.mooncake_compat``,
``import mooncake.store`` gives ``pagewire.mooncake_store`` and ``import
mooncake.buffer_pool`` gives ``pagewire.mooncake_buffer_pool``.

The wheel installs ``pagewire_mooncake.pth`` next to this module; at interpreter start it
calls :func:`install` when the variable is ``1`` (and imports nothing otherwise). The
pagewire wheel owns no ``mooncake/`` directory. With the switch on, the hook answers the
whole ``mooncake`` namespace, whether or not Mooncake's own wheel is installed: its
package is a placeholder (Mooncake's ``__init__`` would import its own store) whose only
names are those Mooncake's exports (``BufferPool``, ``RegisteredBufferPool``), the
modules above are pagewire's, and any other ``mooncake.X`` raises an ``ImportError`` that
names it and says that pagewire does not provide it, so a program never runs on a mix
of the two. With the switch off, nothing changes.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

#: Module names answered by pagewire, and what they resolve to.
ALIASES = {
    "mooncake.buffer_pool": "pagewire.mooncake_buffer_pool",
    "mooncake.engine": "pagewire.mooncake_compat",
    "mooncake.store": "pagewire.mooncake_store",
}


class _Alias(importlib.abc.Loader):
    """Loads a module name as another, already importable module (the same object)."""

    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


#: Names Mooncake's ``mooncake/__init__.py`` exports, and pagewire's module that has them.
PACKAGE_NAMES = {"BufferPool": "pagewire.mooncake_buffer_pool", "RegisteredBufferPool": "pagewire.mooncake_buffer_pool"}


def _package_getattr(name):
    if name in PACKAGE_NAMES:
        # Resolved on first use: the package itself imports nothing (the .pth runs at
        # every interpreter start).
        return getattr(importlib.import_module(PACKAGE_NAMES[name]), name)
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"pagewire does not provide mooncake.{name} (PAGEWIRE_AS_MOONCAKE=1: pagewire answers "
        f"the mooncake package; it provides {', '.join(sorted(ALIASES))})"
    )


class _Package(importlib.abc.Loader):
    """pagewire's ``mooncake`` package: a namespace for the aliased modules only."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = "The mooncake package as pagewire's import hook answers it (PAGEWIRE_AS_MOONCAKE=1)."
        module.__getattr__ = _package_getattr
        module.__all__ = sorted(PACKAGE_NAMES)


class _Refuse(importlib.abc.Loader):
    """A Mooncake module pagewire does not provide: the import fails, naming it."""

    def create_module(self, spec):
        raise ImportError(
            f"pagewire does not provide {spec.name} (PAGEWIRE_AS_MOONCAKE=1: pagewire answers "
            f"the mooncake package and provides {', '.join(sorted(ALIASES))}; unset the "
            "variable to use Mooncake's own)",
            name=spec.name,
        )

    def exec_module(self, module):  # pragma: no cover - create_module raised
        pass


class MooncakeFinder(importlib.abc.MetaPathFinder):
    """Answers ``mooncake`` and every ``mooncake.*`` name (see the module doc)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in ALIASES:
            return importlib.util.spec_from_loader(fullname, _Alias(ALIASES[fullname]))
        if fullname == "mooncake":
            spec = importlib.machinery.ModuleSpec(fullname, _Package(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        if fullname.startswith("mooncake."):
            return importlib.util.spec_from_loader(fullname, _Refuse())
        return None


def install():
    """Puts the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MooncakeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MooncakeFinder())


def uninstall():
    """Removes the finder (modules already imported stay in ``sys.modules``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, MooncakeFinder)]
