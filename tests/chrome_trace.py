"""A checker for the Chrome Trace Event Format rules that Perfetto's JSON importer
relies on (used by the tests on every file the tracer writes)."""

from __future__ import annotations

from collections import defaultdict

PHASES = {"X", "i", "I", "C", "M", "B", "E", "b", "e", "n"}


def check_chrome_trace(doc: dict | list) -> list[str]:
    """Problems found in a Chrome trace (object or array form); empty when it is well formed."""
    problems: list[str] = []
    events = doc if isinstance(doc, list) else doc.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    if isinstance(doc, dict) and doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append("displayTimeUnit must be ms or ns")
    spans = defaultdict(list)
    for n, e in enumerate(events):
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"event {n}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("pid"), int) or ("tid" in e and not isinstance(e["tid"], int)):
            problems.append(f"event {n}: pid/tid must be integers")
        if not isinstance(e.get("name"), str):
            problems.append(f"event {n}: name must be a string")
        if ph == "M":
            # Perfetto reads the first four and passes over others (ddpscope's metadata event)
            if e["name"] not in ("process_name", "thread_name", "process_sort_index", "thread_sort_index", "ddpscope"):
                problems.append(f"event {n}: unknown metadata {e['name']}")
            continue
        if not isinstance(e.get("ts"), (int, float)):
            problems.append(f"event {n}: ts must be a number (µs)")
            continue
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"event {n}: X needs dur >= 0")
            else:
                spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], n))
        if ph == "C" and not all(isinstance(v, (int, float)) for v in (e.get("args") or {}).values()):
            problems.append(f"event {n}: counter values must be numbers")
        if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"event {n}: instant scope must be g, p or t")
    # complete events on one thread must nest (Perfetto drops improperly nested slices)
    for lane, items in spans.items():
        stack: list[tuple[float, float, int]] = []
        for ts, te, n in sorted(items, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= ts + 1e-3:  # 1 ns: float rounding of ts + dur
                stack.pop()
            if stack and te > stack[-1][1] + 1e-3:
                problems.append(f"event {n} on {lane} overlaps event {stack[-1][2]} without nesting")
            stack.append((ts, te, n))
    return problems
