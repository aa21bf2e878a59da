"""``ddpscope run|ring|calibrate --emulate-nodes N --link RATE``: a multi-node job on
one machine.

The launcher builds a ``Lab`` (N network namespaces joined through links shaped to
RATE), then runs one ``ddpscope <command> --nnodes N --node-rank k`` per node inside its
namespace, all into the one folder (the multi-node layout of ``nodes.py``: node 0
owns run.json), gloo bound to the lab's interface. Each node's launcher is a whole
``ddpscope <command>`` (its own torchrun, watchdogs and reaping); this one watches them,
hands on node 0's output and progress (each launcher writes to files this one
follows, so that nothing it writes fails if this one dies), stops them all when one fails or on Ctrl-C, and
removes the lab whatever happened. A node's launcher is told to stop (SIGTERM) if this
process dies, and the next lab removes what was left. Torch-free.
"""

from __future__ import annotations

import collections
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from ddpscope.tracer import format as fmt
from ddpscope.tracer.launch.lab import Lab
from ddpscope.tracer.launch.torchrun import LaunchResult, OnLine, signals_held
from ddpscope.tracer.progress import MESSAGE_PREFIX, PROGRESS_PASSTHROUGH_ENV, parse_progress
from ddpscope.tracer.writer import update_run_json

#: what runs a node's launcher so that it is told to stop (SIGTERM) when this process dies
#: (PR_SET_PDEATHSIG, kept across exec; util-linux's setpriv; without it the node's own
#: watchdogs end it)
_STOP_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
STOP_GRACE_S = 30.0  # a node's launcher stops its job and reaps it within this after SIGTERM


def node_argv(command: list[str], node: int, nodes: int, endpoint: str) -> list[str]:
    """Node ``node``'s ``ddpscope <command>`` from the emulated job's command line
    (``ddpscope <command> [options] ...``, a config's ``command()``): the same settings,
    as one node of ``nodes``. The node's flags go right after the command, before
    anything positional (a script after ``--``, a run folder)."""
    if len(command) < 2 or command[0] != "ddpscope":
        raise ValueError(f"not a ddpscope command line: {command[:2]}")
    argv, rest, i = [], command[2:], 0
    while i < len(rest):
        if rest[i] == "--":  # the script and its arguments: never read as ours
            argv += rest[i:]
            break
        if rest[i] in ("--emulate-nodes", "--link"):
            i += 2
            continue
        if rest[i] == "--out" and i + 1 < len(rest):  # a node runs in the script's folder: this one's --out
            argv += ["--out", str(Path(rest[i + 1]).resolve())]
            i += 2
            continue
        argv.append(rest[i])
        i += 1
    node_flags = ["--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-endpoint", endpoint]
    return [sys.executable, "-m", "ddpscope.cli", command[1], *node_flags, *argv]


def run_emulated(cfg, on_progress: Callable[[dict], None], on_output: OnLine, *, final: Path,
                 record: Path | None) -> LaunchResult:
    """Run ``cfg`` (a config of ``run``, ``ring`` or ``calibrate`` with ``emulate_nodes``,
    ``link``, ``nproc``, ``timeout_s`` and ``command()``) on a lab of that many nodes.
    ``final``: the path node 0 prints last (not handed on); ``record``: the run folder
    whose run.json is told what was emulated (None: leave it)."""
    lines: queue.Queue = queue.Queue()
    tails = {k: collections.deque(maxlen=40) for k in range(cfg.emulate_nodes)}
    procs: list[subprocess.Popen] = []
    # A node's launcher writes to files, not to pipes to this process: if this process
    # dies, the launcher's writes still succeed and its job stops the ordinary way (the
    # SIGTERM of _STOP_WITH_PARENT), never cut short by a pipe with no reader.
    spool = Path(tempfile.mkdtemp(prefix="ddpscope-lab-"))
    try:
        with Lab(cfg.emulate_nodes, cfg.link) as lab:
            command = cfg.command()
            env = {**os.environ, **lab.env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            for node in lab.nodes:
                argv = node_argv(command, node.index, cfg.emulate_nodes, lab.endpoint)
                files = {name: spool / f"node-{node.index}.{name}" for name in ("out", "err")}
                with open(files["out"], "w") as out, open(files["err"], "w") as err:
                    proc = subprocess.Popen([*node.prefix(), *_STOP_WITH_PARENT, *argv], cwd=getattr(cfg, "cwd", None),
                                            stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                            env={**env, PROGRESS_PASSTHROUGH_ENV: "1" if node.index == 0 else "0"})
                procs.append(proc)
                for name, is_err in (("out", False), ("err", True)):
                    threading.Thread(target=_follow, args=(node.index, files[name], is_err, proc, lines),
                                     daemon=True).start()
            interrupted, failed = _watch(cfg, procs, lines, tails, on_progress, on_output,
                                         str(Path(final).resolve()))
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    return _result(cfg, lab, command, procs, tails, interrupted, failed, record)


def _watch(cfg, procs: list[subprocess.Popen], lines: queue.Queue, tails: dict, on_progress, on_output,
           final: str) -> tuple[bool, list[int]]:
    """Until every node's launcher has ended: node 0's lines handed on; all stopped when
    one fails, on Ctrl-C, or past the watchdog. Whether it was interrupted, and the nodes
    whose launchers failed before any was stopped, in the order seen (the first is the
    cause: the others it took down fail too once stopped)."""
    interrupted, failed = False, []
    with signals_held() as stop:  # acted on each turn, never raised mid-call (see torchrun.launch)
        try:
            open_streams = 2 * len(procs)
            deadline = time.monotonic() + cfg.timeout_s + STOP_GRACE_S + 60
            next_poll = 0.0
            while open_streams and (now := time.monotonic()) < deadline and not stop:
                # the launchers polled twice a second, not at every line node 0 prints
                if not failed and now >= next_poll:
                    next_poll = now + 0.5
                    if failed := [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]:
                        _stop(procs)  # one node failed: the others stop too
                try:
                    item = lines.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    open_streams -= 1
                    continue
                k, line, err = item
                tails[k].append(line)
                if k == 0:
                    _hand_on(line, err, final, on_progress, on_output)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            _stop(procs)
            interrupted = interrupted or bool(stop)
    return interrupted, failed


def _result(cfg, lab: Lab, command: list[str], procs: list[subprocess.Popen], tails: dict,
            interrupted: bool, failed: list[int], record: Path | None) -> LaunchResult:
    """How the emulated run ended (the node that failed first says why, never one this
    launcher stopped because of it); run.json told what was emulated."""
    codes = [p.returncode for p in procs]
    result = LaunchResult(returncode=next((c for c in codes if c), 0), interrupted=interrupted)
    if result.returncode or interrupted:
        bad = failed[0] if failed else next((k for k, c in enumerate(codes) if c), 0)
        said = [line for line in tails[bad] if "run failed:" in line or "error:" in line]
        # its own "ddpscope <command>: run failed: <why>": the why alone (this launcher says the rest)
        why = said[-1].split(": ", 1)[-1].removeprefix("run failed: ") if said else \
            f"its launcher exited with code {codes[bad]}"
        result.reason = "interrupted" if interrupted else why if bad == 0 else f"node {bad}: {why}"
        result.stderr_tail = "\n".join(tails[bad])
    if record is not None and record.is_dir() and (record / fmt.RUN_FILE).exists():
        update_run_json(record, {"emulation": emulation_facts(cfg.emulate_nodes, lab.rate, cfg.nproc),
                                 "command": " ".join(command)})
    return result


def emulation_facts(nodes: int, link: str, nproc: int) -> dict:
    """What a lab emulates, as run.json and calibration.json record it."""
    from ddpscope.tracer.launch.lab import parse_rate

    return {"nodes": nodes, "link": link, "link_bps": parse_rate(link), "nproc_per_node": nproc,
            "shaped": "egress of each node's link, both ways (tc tbf)",
            "not_emulated": "latency, switch topology, NVLink"}


def _hand_on(line: str, err: bool, final: str, on_progress, on_output: OnLine) -> None:
    """Node 0's launcher's line: a progress record, its rank 0's output, or its own line
    (not those this launcher says itself: what it traces, where it writes)."""
    rec = parse_progress(line)
    if rec is not None:
        on_progress(rec)
    elif line.strip() == final or line.startswith((MESSAGE_PREFIX + "tracing ", MESSAGE_PREFIX + "showing ")):
        return
    else:
        on_output(0, line, err)


def _follow(node: int, path: Path, err: bool, proc: subprocess.Popen, lines: queue.Queue) -> None:
    """Hand on the lines of a node launcher's output file as they are written, to its end."""
    try:
        with open(path, errors="replace") as f:
            part = ""
            while True:
                text = f.readline()
                if text:
                    part += text
                    if part.endswith("\n"):
                        lines.put((node, part.rstrip("\n"), err))
                        part = ""
                elif proc.poll() is None:
                    time.sleep(0.05)
                elif not (text := f.read()):  # ended, and all it wrote is read
                    break
                else:
                    part += text
            if part:
                lines.put((node, part.rstrip("\n"), err))
    finally:
        lines.put(None)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Every node's launcher stopped (SIGTERM: it stops its job and reaps it) and reaped."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
