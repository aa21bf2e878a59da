"""The house keeps its shape, read from the code's own imports (``ast``, every import
statement, those inside functions and under ``TYPE_CHECKING`` too):

- no import circle between modules, counting the package ``__init__`` that importing a
  module runs first (``a.b.c`` runs ``a/b/__init__.py``);
- data flows one way: the capture side (``tracer``: capture, launch, workloads and the
  shared format, writer and options) imports nothing from ``viz``, ``dashboard`` or the
  command (``cli``); ``viz`` nothing from ``dashboard`` or ``cli``; ``dashboard`` nothing
  from ``cli``. A package's ``__main__`` (``python -m ddpscope.tracer``, an alias of the
  command) is an entry point, not a room: nothing imports it, so it is left out;
- at most ``VIZ_LOOSE`` files at ``viz/``'s top, the rest in rooms;
- no module over ``MAX_LINES`` lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

FOLDERS = {"cli": "ddpscope.cli", "tracer": "ddpscope.tracer", "viz": "ddpscope.viz",
           "dashboard": "ddpscope.dashboard"}
# what each side may not import (by the first name under ddpscope)
FORBIDDEN = {"tracer": {"viz", "dashboard", "cli"}, "viz": {"dashboard", "cli"}, "dashboard": {"cli"}}
VIZ_LOOSE = 10
MAX_LINES = 450


def modules() -> dict[str, Path]:
    """Every module of the installed packages: dotted name -> file."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that importing ``name`` (at ``path``) imports, with the
    package ``__init__`` each import runs on the way (not ``name``'s own packages: they
    have run before it)."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from this module's package
                package = name if is_package else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{base}" if base else package
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    own = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)} | {name}
    out = set()
    for target in targets:
        parts = target.split(".")
        for k in range(1, len(parts) + 1):  # the target and every package above it
            prefix = ".".join(parts[:k])
            if prefix in known and prefix not in own:
                out.add(prefix)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on:
                low[v] = min(low[v], index[child])
    return out


def test_the_reader_sees_imports_and_the_finder_sees_circles():
    """The checks below cannot pass by reading nothing: known arrows are seen (a lazy one
    inside a function too, and the package ``__init__`` an import runs), and a circle
    made by hand is found, while its broken version is not."""
    graph = import_graph()
    assert "ddpscope.viz.lanes" in graph["ddpscope.viz.ddp.gantt"]
    assert "ddpscope.viz.ddp.kernel_gantt" in graph["ddpscope.viz.ddp.gantt"]  # imported inside a function
    assert "ddpscope.viz.sources" in graph["ddpscope.cli.reading"]  # the package run on the way in
    assert "ddpscope.tracer.capture.ddp.comm_hook" in graph["ddpscope.tracer.capture.ddp.tracer"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_its_way_back_to_itself():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_data_flows_one_way():
    wrong = []
    for name, targets in import_graph().items():
        if name.endswith(".__main__"):  # an entry point (see the module's docstring)
            continue
        side = name.split(".")[1]
        for target in targets:
            if target.split(".")[1] in FORBIDDEN.get(side, ()):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the flow: " + ", ".join(sorted(wrong))


def test_viz_keeps_its_files_in_rooms():
    loose = sorted(p.name for p in (ROOT / "viz").glob("*.py"))
    assert len(loose) <= VIZ_LOOSE, f"{len(loose)} files loose at viz/'s top: {loose}"


@pytest.mark.parametrize("top", sorted(FOLDERS))
def test_no_module_is_over_the_size_limit(top):
    big = {str(p.relative_to(ROOT)): n for p in (ROOT / top).rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_old_import_paths_give_the_moved_modules_for_this_release():
    """0.2's paths that users import from Python (the metrics and figures by module,
    ``DDPTracer``'s module, ``viz.ring``'s functions) give the moved modules, saying so."""
    import importlib
    import sys
    import warnings

    from ddpscope.viz.ring import compute_ring_summary
    from ddpscope.viz.ring.metrics import compute_ring_summary as moved

    assert compute_ring_summary is moved
    for old, new in [("ddpscope.viz.overlap", "ddpscope.viz.ddp.overlap"),
                     ("ddpscope.viz.sharded_metrics", "ddpscope.viz.sharded.metrics"),
                     ("ddpscope.tracer.capture.tracer", "ddpscope.tracer.capture.ddp.tracer")]:
        sys.modules.pop(old, None)  # imported by the old name anew, whatever ran before
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert importlib.import_module(old) is importlib.import_module(new)
        assert [w.category for w in seen if new in str(w.message)] == [DeprecationWarning]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ddpscope.viz.no_such_module")
