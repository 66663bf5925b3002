"""Opt-in import hook: with ``PAGEWIRE_AS_MOONCAKE=1``, ``import mooncake.engine`` gives
``pagewire.mooncake_compat``.

The wheel installs ``pagewire_mooncake.pth`` next to this module; at interpreter start it
calls :func:`install` when the variable is ``1`` (and imports nothing otherwise). The
pagewire wheel owns no ``mooncake/`` directory: when the real Mooncake is installed its
package stays importable (``mooncake.store`` and the rest are Mooncake's), only
``mooncake.engine`` is redirected; without it, an empty ``mooncake`` package is
provided so that ``mooncake.engine`` resolves.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

#: Module names answered by pagewire, and what they resolve to.
ALIASES = {"mooncake.engine": "pagewire.mooncake_compat"}


class _Alias(importlib.abc.Loader):
    """Loads a module name as another, already importable module (the same object)."""

    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _EmptyPackage(importlib.abc.Loader):
    """An empty ``mooncake`` package, when the real one is not installed."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = "Placeholder package created by pagewire's mooncake import hook."


class MooncakeFinder(importlib.abc.MetaPathFinder):
    """Redirects the names in :data:`ALIASES`; finds nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in ALIASES:
            return importlib.util.spec_from_loader(fullname, _Alias(ALIASES[fullname]))
        if fullname == "mooncake":
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return None  # the real Mooncake: let the normal import load it
            spec = importlib.machinery.ModuleSpec(fullname, _EmptyPackage(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None


def install():
    """Puts the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MooncakeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MooncakeFinder())


def uninstall():
    """Removes the finder (modules already imported stay in ``sys.modules``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, MooncakeFinder)]
