"""``after_import`` (tracer/capture/autotrace/after_import.py): the callback runs once the
module is really loaded, not when it is first looked for. Transformers asks
``importlib.util.find_spec("deepspeed")`` long before Accelerate imports DeepSpeed; a
finder that left at that probe missed the import, and a Hugging Face Trainer's DeepSpeed
run went untraced."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from ddpscope.tracer.capture.autotrace.after_import import _AfterImport, after_import


def test_a_probe_does_not_use_up_the_hook_and_the_import_runs_it_once(tmp_path, monkeypatch):
    name = "ddpscope_probe_target"
    (tmp_path / f"{name}.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import(name, lambda m: seen.append(m.VALUE))
    try:
        assert importlib.util.find_spec(name) is not None and name not in sys.modules  # the probe
        assert seen == [] and any(isinstance(f, _AfterImport) for f in sys.meta_path)
        module = importlib.import_module(name)
        assert seen == [41] and module.VALUE == 41
        assert not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path)
        importlib.reload(module)  # the module's own loader again: no second callback
        assert seen == [41]
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _AfterImport) and f.name == name)]
        sys.modules.pop(name, None)


def test_an_imported_module_is_patched_at_once():
    seen = []
    after_import("json", lambda m: seen.append(m.__name__))
    assert seen == ["json"]
