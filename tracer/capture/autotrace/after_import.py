"""``after_import(name, callback)``: run ``callback(module)`` once the module ``name`` is
imported, without importing it first (the capture never imports torch before the
script does). A finder on ``sys.meta_path`` wraps that module's own loader: the module is
loaded as it would be, then patched; a patch that fails is said in one line and the
import goes on. The finder leaves when the module is loaded, not when it is first looked
for: a probe (``importlib.util.find_spec``, as Transformers' ``is_deepspeed_available``
does) finds the module without loading it, and the real import comes later. Torch-free."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

from ddpscope.tracer.progress import say


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then ``callback(module)``."""

    def __init__(self, loader, callback: Callable, finder: _AfterImport) -> None:
        self._loader, self._callback, self._finder = loader, callback, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self._finder in sys.meta_path:  # loaded now: the finder's work is done
            sys.meta_path.remove(self._finder)
        self._loader.exec_module(module)
        try:
            self._callback(module)
        except Exception as e:  # noqa: BLE001 - never break the import of torch
            say(f"tracing disabled: could not patch {module.__name__}: {type(e).__name__}: {e}")


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that wraps one module's loader, until that module is loaded."""

    def __init__(self, name: str, callback: Callable) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # the module's own finders, without this one (no recursion)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader, self.callback, self)
        return spec


def after_import(name: str, callback: Callable) -> None:
    """``callback(module)`` once ``name`` is imported (at once if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))
