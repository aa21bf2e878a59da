"""Old import paths, kept for this release (0.3) after the move into rooms: a package lists
its moved modules, one line each (old name -> new name), and importing an old name gives
the very module at its new path (``ddpscope.viz.overlap`` is ``ddpscope.viz.ddp.overlap``),
with a ``DeprecationWarning`` naming the new path. Names that moved to another module
(``merge_intervals`` to ``viz.intervals``, ``select_steps`` to ``viz.lanes``) are not
covered: the README's Layout section says where each one is."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, table: dict[str, str]) -> None:
        self.table = table

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.table:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = self.table[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes after this release",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # the module at its new path has run already
        return None


def alias_moved(package: str, moved: dict[str, str]) -> None:
    """Serve ``package.<old>`` as ``package.<new>`` for each ``old: new`` of ``moved``
    (names relative to ``package``); once per package."""
    table = {f"{package}.{old}": f"{package}.{new}" for old, new in moved.items()}
    if not any(isinstance(f, _Alias) and f.table == table for f in sys.meta_path):
        sys.meta_path.append(_Alias(table))
