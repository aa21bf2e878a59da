"""Processes as Linux's /proc shows them: is a pid alive (a zombie is not), and every
live descendant of a pid (torchrun's ranks, a rank's own children)."""

from __future__ import annotations

import os


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses):
    ``[state, ppid, ...]``; raises ``OSError`` when the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """``pid`` runs (exists and is not a zombie waiting to be reaped)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid``, at any depth."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(entry)[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out
