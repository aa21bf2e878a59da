"""The emulated-nodes launcher's watch over its nodes, without a lab: real processes
stand in for the nodes' launchers (the lab itself is tested in test_lab.py, marked)."""

from __future__ import annotations

import collections
import queue
import subprocess
import sys
import threading
from types import SimpleNamespace

from ddpscope.tracer.launch import emulated

# node 0 runs on until stopped, then says it was interrupted (as a node's launcher does on SIGTERM)
_STOPPED = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("ddpscope ring: run failed: interrupted: the job was stopped",
                                                 file=sys.stderr, flush=True), sys.exit(1)))
open(sys.argv[1], "w").close()  # its handler is in place: node 1 may fail now
time.sleep(60)
"""
# node 1 fails on its own, as soon as node 0 is up (a slow start would die of the signal, -15)
_FAILS = """
import os, sys, time
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)
print("ddpscope ring: run failed: --out /x is not empty; choose a new folder", file=sys.stderr, flush=True)
sys.exit(2)
"""


def _follow(k, proc, lines):
    for line in proc.stderr:
        lines.put((k, line.rstrip("\n"), True))
    lines.put(None)
    lines.put(None)  # its stdout: never used here


def test_the_node_that_failed_first_is_named_not_the_one_stopped_because_of_it(tmp_path):
    ready = str(tmp_path / "node0-ready")
    procs = [subprocess.Popen([sys.executable, "-c", code, ready], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for code in (_STOPPED, _FAILS)]
    lines: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_follow, args=(k, p, lines), daemon=True) for k, p in enumerate(procs)]
    for t in threads:
        t.start()
    tails = {k: collections.deque(maxlen=40) for k in range(2)}
    cfg = SimpleNamespace(timeout_s=60, emulate_nodes=2, nproc=1)
    interrupted, failed = emulated._watch(cfg, procs, lines, tails, lambda rec: None, lambda *a: None, "/final")
    assert (interrupted, failed) == (False, [1])
    assert [p.returncode for p in procs] == [1, 2]  # node 0 was stopped: it fails too
    result = emulated._result(cfg, None, ["ddpscope", "ring"], procs, tails, interrupted, failed, record=None)
    assert result.reason == "node 1: --out /x is not empty; choose a new folder", result.reason
    assert "interrupted" not in result.stderr_tail
