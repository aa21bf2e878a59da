"""Shared fixtures: real demo runs (made once per session) and helpers to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
KINETO = ROOT.parent / "shared" / "data" / "kineto"


def workers_env() -> dict[str, str]:
    """For jobs that run ``-m tests.workers.X``: the checkout on their path (ddpscope
    itself is the installed package; the CLI's own jobs never get the checkout)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def run_cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``ddpscope ...`` (``python -m ddpscope.cli``) in a fresh process, from a folder that is
    not the project, with ddpscope imported as installed."""
    return subprocess.run(
        [sys.executable, "-m", "ddpscope.cli", *args], cwd="/", capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_refused(command: str, args: list[str], message: str, out: Path) -> None:
    """``ddpscope COMMAND ARGS --out OUT`` refuses: exit 2, one line naming the
    problem, nothing written."""
    proc = run_cli(command, *args, "--out", str(out), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not out.exists()


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z" and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


@pytest.fixture(scope="session")
def mlp_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A real 2-rank traced run of the demo MLP at bucket_cap_mb=1 (6 steps)."""
    out = tmp_path_factory.mktemp("runs") / "mlp-cap1"
    proc = run_cli("run", "--nproc", "2", "--demo", "mlp", "--steps", "6", "--bucket-cap-mb", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def ring_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A real traced ring all-reduce: 4 ranks, 1 MiB float32, 3 timed rounds per size."""
    out = tmp_path_factory.mktemp("rings") / "ring4"
    proc = run_cli("ring", "--nproc", "4", "--mb", "1", "--repeat", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def zero_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A real ZeRO run: the demo MLP on 2 ranks, 3 steps under each of stages 0-3."""
    out = tmp_path_factory.mktemp("zero") / "mlp"
    proc = run_cli("zero", "--nproc", "2", "--model", "mlp", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def profiled_run(tmp_path_factory) -> Path:
    """A real 2-rank traced run of the demo MLP, torch.profiler on its first 4 steps."""
    out = tmp_path_factory.mktemp("profiled") / "mlp-profile"
    proc = run_cli("run", "--nproc", "2", "--demo", "mlp", "--steps", "6", "--bucket-cap-mb", "1", "--profile",
                   "--profile-steps", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def deepspeed_two_then_three(tmp_path_factory) -> dict:
    """A real 2-rank DeepSpeed job traced at ZeRO-2 (3 steps, reduce_bucket_size 20,000
    elements), then the same script rerun by ``--zero-stage 3``, as the Run page reruns it:
    ``{"two", "three"}`` their run folders, ``"report3"`` the rerun's own report, ``"stderr3"``
    what the rerun said. Traced once for the tests that read the pair (a DeepSpeed job costs
    ~15 s of CI's lane B): the stage prediction's, and the rerun check's."""
    pytest.importorskip("deepspeed")
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS, trace_script

    tmp, env = tmp_path_factory.mktemp("deepspeed-2-3"), {"DS_ACCELERATOR": "cpu"}
    script = (str(WORKERS / "deepspeed_train.py"), "--stage", "2", "--steps", "3", "--reduce-bucket-size", "20000")
    proc, two, _ = trace_script(tmp, *script, name="two", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, three, report3 = trace_script(tmp, *script, name="three", env=env, ddpscope=("--zero-stage", "3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"two": two, "three": three, "report3": report3, "stderr3": proc.stderr}


@pytest.fixture(scope="session", autouse=True)
def compiled_capture() -> dict:
    """The compiled capture, built once before any test (as ``.ci/run`` and ``ddpscope
    run`` do) so the tests run the path users get; where it cannot be built, they run the
    Python hooks (tests/tracer/capture/ddp/test_compiled.py then fails, saying why)."""
    from ddpscope.tracer.capture.native.build import ensure_built

    return ensure_built()
