"""Launching a job through torchrun (``torch.distributed.run``) and always cleaning up.

Guarantees: every process the job started is reaped (torchrun, and its workers, which
torchrun puts in sessions of their own), a watchdog ends a job that outlives its
timeout, Ctrl-C ends the job rather than orphaning it, and a failure comes back as the
failing rank, a one-line reason and the tail of that rank's stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddpscope.tracer.launch.hangs import Hang, HangWatch, read_positions
from ddpscope.tracer.launch.known_failures import known_cause
from ddpscope.tracer.launch.procfs import alive, descendants

# A rank that failed only because a peer died says so; it is not the root cause.
_PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crashing|"
    r"NCCL communicator was aborted|Socket Timeout|timed out|ProcessGroup.*abort",
    re.IGNORECASE,
)
_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*(\d+)\]:(.*)$")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(kw_only=True)
class LaunchConfig:
    """One torchrun job: ``target`` (a module run with ``-m`` when ``module``, else a
    script path) with ``args``, in the working directory ``cwd``."""

    target: str
    args: list[str] = field(default_factory=list)
    module: bool = True
    cwd: Path | None = None
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # "host:port"; default 127.0.0.1 and a free port
    log_dir: Path
    timeout_s: float = 900.0
    env: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None  # the run folder: where the ranks' live files are (hang watchdog)
    hang_timeout_s: float = 0.0  # no rank moves for this long: named, stacks saved, stopped (0: off)

    def __post_init__(self) -> None:
        self.log_dir = Path(self.log_dir).resolve()  # the job runs in cwd, not ours
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
        if self.rdzv_endpoint is not None and not re.fullmatch(r"[\w.\-]+:\d{1,5}", self.rdzv_endpoint):
            raise ValueError(f"--rdzv-endpoint must look like HOST:PORT, got {self.rdzv_endpoint!r}")


@dataclass
class LaunchResult:
    returncode: int
    timed_out: bool = False
    interrupted: bool = False
    failed_rank: int | None = None
    reason: str | None = None  # one line
    stderr_tail: str = ""
    untraced: str | None = None  # the job ran, but nothing could be traced: why
    incomplete: str | None = None  # the job ran to its end, its trace did not: which ranks stopped where
    after_training: str | None = None  # a rank failed after every rank had closed its trace (at exit): what
    elsewhere: str | None = None  # a multi-node job whose other nodes wrote their own folders: how to join them
    hung: bool = False  # the hang watchdog stopped it
    how: str | None = None  # how the failed rank ended: "SIGKILL", "exit code 3", "RuntimeError: ..."
    where: str | None = None  # what it last recorded: "step 12, backward"
    consequences: list[str] = field(default_factory=list)  # the other ranks' failures, one line each
    # other ranks that failed on their own (an error of their own, not a lost peer), one line each
    independent: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # a hang: what every rank last recorded

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def torchrun_command(cfg: LaunchConfig) -> list[str]:
    endpoint = cfg.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(cfg.nproc), "--nnodes", str(cfg.nnodes),
        "--node-rank", str(cfg.node_rank),
        # static rendezvous: node 0 hosts the store at the endpoint; ranks are deterministic
        "--rdzv-backend", "static", "--rdzv-endpoint", endpoint,
        "--max-restarts", "0", "--log-dir", str(cfg.log_dir), "--tee", "3",
        *(["-m"] if cfg.module else []), cfg.target, *cfg.args,
    ]


OnLine = Callable[[int | None, str, bool], None]
"""``on_line(rank, text, err)``: a line of the job's output. ``rank``: the local rank whose
output it is (None: the launcher's own); ``err``: it came on stderr."""


def launch(cfg: LaunchConfig, on_line: OnLine = lambda r, l, e: None) -> LaunchResult:
    """Run the job to its end; ``on_line`` sees its output as it comes (``OnLine``)."""
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **cfg.env}
    proc = subprocess.Popen(
        torchrun_command(cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True, text=True, errors="replace", bufsize=1, cwd=cfg.cwd,
    )
    # torchrun --tee copies each rank's stdout to its stdout and stderr to its stderr
    lines: queue.Queue[tuple[str, bool] | None] = queue.Queue()
    readers = [threading.Thread(target=_pump, args=(stream, lines, err), daemon=True)
               for stream, err in ((proc.stdout, False), (proc.stderr, True))]
    for reader in readers:
        reader.start()
    open_streams = len(readers)
    deadline = time.monotonic() + cfg.timeout_s
    timed_out = interrupted = False
    hang = None
    watch = HangWatch(cfg.run_dir, cfg.hang_timeout_s) if cfg.run_dir is not None and cfg.hang_timeout_s > 0 else None
    agent: deque[str] = deque(maxlen=400)  # torchrun's own lines: its summary of how each rank ended
    workers: set[int] = set()
    # Ctrl-C and SIGTERM are held while the job runs and while it is stopped: raised as
    # KeyboardInterrupt at any point they could break a lock mid-release (a queue's: then
    # "RuntimeError: release unlocked lock" ends the launcher with its job still running)
    # or cut the stop short; the loop looks at them each turn (<= 0.5 s)
    with signals_held() as stop:
        try:
            while open_streams:
                if stop:  # Ctrl-C or SIGTERM: noted by the handler, acted on here (never mid-call: see above)
                    interrupted = True
                    break
                if watch is not None and (hang := watch.poll()) is not None:
                    break
                if watch is not None and watch.stood_down:  # said once: nothing is watched from now on
                    watch = None
                    print(f"ddpscope run: {cfg.run_dir} cannot be written: the hang watchdog stands down "
                          f"(the --timeout of {cfg.timeout_s:.0f} s still applies)", file=sys.stderr, flush=True)
                try:
                    item = lines.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                except queue.Empty:
                    workers |= descendants(proc.pid)  # remember them: torchrun may die first
                    if time.monotonic() >= deadline:
                        timed_out = True
                        break
                    continue
                if item is None:
                    open_streams -= 1
                    continue
                line, err = item
                m = _RANK_PREFIX.match(line)
                if m:
                    on_line(int(m.group(1)), m.group(2), err)
                else:
                    agent.append(line)
                    on_line(None, line, err)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            workers |= descendants(proc.pid)
            _terminate(proc, workers)
            interrupted = interrupted or bool(stop)
            for reader in readers:
                reader.join(timeout=5)
            while True:  # what the readers had left: torchrun's summary comes last
                try:
                    item = lines.get_nowait()
                except queue.Empty:
                    break
                if item is not None and not _RANK_PREFIX.match(item[0]):
                    agent.append(item[0])
    return job_result(cfg, proc.returncode, timed_out, interrupted, hang=hang, exits=agent_exits(list(agent)))


def job_result(cfg: LaunchConfig, returncode: int, timed_out: bool, interrupted: bool, hang: Hang | None = None,
               exits: dict[int, int] | None = None) -> LaunchResult:
    """How a job ended, with the reason and the failing rank when it did not end well.
    ``exits``: global rank -> exit code (negative: killed by that signal), where known."""
    result = LaunchResult(returncode=returncode, timed_out=timed_out, interrupted=interrupted)
    if hang is not None:
        result.hung, result.timed_out = True, True
        result.reason, result.failed_rank, result.details = hang.reason, hang.stuck[0], hang.details
        result.how, result.where = "hung", None
        return result
    if timed_out:
        result.reason = f"watchdog: the job ran past --timeout {cfg.timeout_s:g} s and was stopped"
    elif interrupted:
        result.reason = "interrupted: the job was stopped"
    if not result.ok or interrupted:
        explain_failure(cfg, result, exits or {})
    return result


# torchrun's summary of a failed job, one block per failed rank:
#   rank      : 1 (local_rank: 1)
#   exitcode  : -9 (pid: 15672)  (SIGKILL)
_AGENT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
_AGENT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def agent_exits(lines: list[str]) -> dict[int, int]:
    """Global rank -> exit code from torchrun's failure summary (empty if none). The rank
    torchrun names as the root cause (first observed failure) comes first."""
    out: dict[int, int] = {}
    root: int | None = None
    rank = None
    in_root = False
    for line in lines:
        if "Root Cause" in line:
            in_root = True
        if m := _AGENT_RANK.match(line):
            rank = int(m.group(1))
        elif (m := _AGENT_EXIT.match(line)) and rank is not None:
            out[rank] = int(m.group(1))
            if in_root and root is None:
                root = rank
            rank = None
    if root is not None:
        out = {root: out[root], **{r: c for r, c in out.items() if r != root}}
    return out


def signal_name(code: int) -> str | None:
    """``SIGKILL`` for an exit code of -9 (a process killed by a signal), else None."""
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _how_killed(code: int) -> str:
    name = signal_name(code)
    if name == "SIGKILL":
        return "was killed by SIGKILL (the kernel's out-of-memory killer, or kill -9)"
    if name == "SIGTERM":
        return "was stopped by SIGTERM (torchrun stops the other ranks when one fails)"
    return f"was killed by {name}"


def _pump(stream, lines: queue.Queue, err: bool) -> None:
    for line in stream:
        lines.put((line.rstrip("\n"), err))
    lines.put(None)


@contextlib.contextmanager
def signals_held():
    """Ctrl-C and SIGTERM held (noted, not raised) inside the block, in the main thread
    (where Python delivers them); yields the list of those that came."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    before = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield held
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _terminate(proc: subprocess.Popen, workers: set[int], grace_s: float = 10.0) -> None:
    """Stop torchrun (it stops its workers on SIGTERM), then kill whatever is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for pid in [proc.pid, *workers]:
        if pid == proc.pid and proc.poll() is not None:
            continue
        if alive(pid):
            kill_group(pid)
    proc.wait()


def kill_group(pid: int) -> None:
    """SIGKILL ``pid``'s process group (a rank leads its own session), else ``pid``."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def explain_failure(cfg: LaunchConfig, result: LaunchResult, exits: dict[int, int] | None = None) -> None:
    """The root cause and its consequences. A rank killed by a signal comes first (the
    others fail because it went away); then a rank whose own error is not a peer's
    failure; ranks that failed only because a peer died are consequences, and other ranks
    with an error of their own failed independently (named as such). Errors come
    from torchrun's per-rank error files (``@record``, or ddpscope's capture for scripts
    without it), else the ranks' stderr; how a rank ended from torchrun's summary."""
    base = cfg.node_rank * cfg.nproc
    errors: dict[int, tuple[bool, int, str]] = {}  # global rank -> (peer failure, time_ns, message)
    for err in cfg.log_dir.glob("*/attempt_*/*/error.json"):
        try:
            data = json.loads(err.read_text())
            msg = data["message"]
            if isinstance(msg, dict):
                extra = msg.get("extraInfo", {})
                ts, text = int(extra.get("time_ns") or int(extra.get("timestamp", 0)) * 10**9), str(msg.get("message", ""))
            else:
                ts, text = int(data.get("timestamp", 0)) * 10**9, str(msg)
            errors[base + int(err.parent.name)] = (bool(_PEER_FAILURE.search(text)), ts, _last_error_line(text))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    tails = {base + int(log.parent.name): _tail(log, 200) for log in cfg.log_dir.glob("*/attempt_*/*/stderr.log")}
    for rank, text in tails.items():
        if rank not in errors and (line := _exception_line(text)) is not None:
            errors[rank] = (bool(_PEER_FAILURE.search(line)), 0, line[:300])
    # a rank that exited with a code of its own and no traceback (sys.exit, the script's argparse)
    # said why on stderr, if anywhere: its last line
    for rank, code in (exits or {}).items():
        if code > 0 and rank not in errors and (line := _last_line(tails.get(rank, ""))) is not None:
            errors[rank] = (False, 0, f"exited with code {code}; its last line on stderr: {line}")
    # The root cause, in this order: a rank killed by a signal (torchrun's root cause
    # first), a rank with an error of its own (earliest first), a rank stopped by SIGTERM
    # (how torchrun stops the others once one failed), a rank that lost a peer.
    killed = [r for r, c in (exits or {}).items() if c < 0 and r not in errors]
    order = [(0, i, r) for i, r in enumerate(killed) if exits[r] != -signal.SIGTERM]
    order += [(1 if not peer else 3, ts, r) for r, (peer, ts, _) in errors.items()]
    order += [(2, i, r) for i, r in enumerate(killed) if exits[r] == -signal.SIGTERM]
    if order:
        root = min(order)[2]
        if root in errors:
            how, result.how = f"failed: {errors[root][2]}", errors[root][2]
        else:
            how, result.how = _how_killed(exits[root]), signal_name(exits[root])
    else:
        code = next((c for c in (exits or {}).values() if c != 0), None)
        if result.reason is None:
            result.reason = (f"the job exited with code {code if code is not None else result.returncode} "
                             "(killed or crashed without a Python error)")
        return
    result.failed_rank = root
    result.where = _last_position(cfg, root)
    at = f"; it was at {result.where}" if result.where else ""
    # Beside a root that failed with an error of its own, a rank with an error of its own failed
    # independently; beside a rank killed by a signal, every other failure is taken as its consequence.
    own = root in errors and not errors[root][0]
    alone = {r for r, (peer, _, _) in errors.items() if own and r != root and not peer}
    result.independent = [f"rank {r}: {errors[r][2]}" for r in sorted(alone)]
    result.consequences = [f"rank {r}: {text}" for r, (_, _, text) in sorted(errors.items()) if r != root and r not in alone]
    result.consequences += [f"rank {r} {_how_killed(exits[r])}" for r in killed if r != root]
    if result.reason is None:
        result.reason = f"rank {root} {how}{at}"
        if alone:
            others = sorted(alone)
            result.reason += (f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} also failed on "
                              f"{'their' if len(others) > 1 else 'its'} own")
        if result.consequences:
            result.reason += f" (then {len(result.consequences)} other rank{'s' if len(result.consequences) > 1 else ''} failed)"
        if (cause := known_cause(result.how)) is not None:
            result.reason += f" ({cause})"
    if (log := _stderr_log(cfg, root)) is not None:
        result.stderr_tail = _tail(log)


def _stderr_log(cfg: LaunchConfig, rank: int) -> Path | None:
    """Global ``rank``'s stderr as torchrun kept it (this node's), None if there is none."""
    return next(iter(cfg.log_dir.glob(f"*/attempt_*/{rank - cfg.node_rank * cfg.nproc}/stderr.log")), None)


def _last_line(text: str) -> str | None:
    """The last non-empty line of a rank's stderr (rank prefix off, 300 characters at most)."""
    return next((line[:300] for line in map(_unprefixed, reversed(text.splitlines())) if line), None)


def _unprefixed(line: str) -> str:
    """A rank's output line without torchrun's rank prefix, stripped."""
    m = _RANK_PREFIX.match(line)
    return (m.group(2) if m else line).strip()


def _last_position(cfg: LaunchConfig, rank: int) -> str | None:
    """What ``rank`` last recorded (its live file): "step 12, backward", or None."""
    if cfg.run_dir is None:
        return None
    p = read_positions(cfg.run_dir).get(rank)
    if not p:
        return None
    text = f"step {p.get('step')}, {p.get('phase')}"
    if p.get("buckets_in_flight"):
        text += f" (bucket {p['buckets_in_flight'][0]} in flight)"
    return text


def _exception_line(text: str) -> str | None:
    """The last ``SomeError: message`` line of a traceback in ``text`` (rank prefixes off)."""
    found = None
    for line in map(_unprefixed, text.splitlines()):
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", line):
            found = line
    return found


def _last_error_line(text: str) -> str:
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    for l in lines:
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", l):
            return l[:300]
    return (lines[-1] if lines else "unknown error")[:300]


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
