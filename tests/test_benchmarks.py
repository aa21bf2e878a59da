"""Benchmarks that do not rot: every script in ``benchmarks/`` runs in its ``--smoke`` mode
(tiny sizes, one repeat) and prints its table. Times are never asserted; that a script
runs and says what it measured is. Marked ``benchmarks``: ``.ci/run`` runs them after the
tests (``pytest -m benchmarks``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import KINETO, ROOT

pytestmark = pytest.mark.benchmarks

# script -> a line its table prints (the header or the verdict of what it measured)
PRINTS = {
    "gantt": "speed-up: build",
    "writer": "flush of 4 steps, writer thread, by run length:",
    "overhead": "where the full tracer's time goes",
    "sharded": "prediction: from each trace the other reshard_after_forward",
    "whatif": "model   replay%  stepMAE%",
    "kineto": "figures per rank, % (ddpscope / HTA):",
    "rerun": "click -> new timeline on screen",
    "first_chart": "Timeline (/): first chart",
    "overview": "overview drawn (heatmap + spread)",
    "many_ranks": "summary-first",
    "advisor": "workload  link        MAPE %",
    "deepspeed": "goal traced <= 1.02 at every stage",
    "deepspeed_buckets": "buckets exact",
    "idle_page": "goal <= 1 % each (ddpscope dashboard)",
    "cuda_overhead": "traced / untraced:",
}

# more than --smoke, by script: deepspeed's stage 3 is smoke-run under ZeRO-Offload instead
# (test_deepspeed_overhead_is_measured_under_zero_offload_...): one job fewer in CI's lane B
SMOKE_ARGS = {"deepspeed": ["--stages", "1,2"]}


def test_every_benchmark_script_has_a_smoke_run_here():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    assert scripts == set(PRINTS)
    for name in scripts:
        assert "--smoke" in (ROOT / "benchmarks" / f"{name}.py").read_text(), name


def smoke(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<name> --smoke *args``, run from the project's root."""
    # What a script leaves behind goes with the test: a folder of its own, short, as Chromium's
    # profile holds a Unix socket whose path must stay under 108 bytes (pytest's tmp_path,
    # /tmp/pytest-of-root/pytest-<N>/test_benchmark_runs_in_its_smo<k>/..., passes it once N has 3 digits)
    tmp = Path(tempfile.mkdtemp(prefix="ddpb-"))
    try:
        return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke", *args], cwd=ROOT,
                              env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# whatif's smoke run is test_whatif_predicts_again_from_the_runs_it_kept's first (the same
# --smoke, its table checked there): not run twice
@pytest.mark.parametrize("name", sorted(set(PRINTS) - {"whatif"}))
def test_benchmark_runs_in_its_smoke_mode_and_prints_its_table(name):
    if name == "kineto" and not KINETO.exists():
        pytest.skip("needs ../shared/data/kineto beside the project")
    if name in ("deepspeed", "deepspeed_buckets"):
        pytest.importorskip("deepspeed")
    if name in ("rerun", "first_chart", "overview", "idle_page") and not os.path.exists("/usr/bin/chromium"):
        pytest.skip("needs Debian's chromium (apt-get install -y chromium)")
    proc = smoke(name, *SMOKE_ARGS.get(name, []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert PRINTS[name] in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr


def test_whatif_predicts_again_from_the_runs_it_kept(tmp_path):
    """``benchmarks.whatif --smoke --work DIR`` keeps its runs there; ``--from DIR``
    predicts again from them, tracing and running nothing (no folder added or changed),
    and prints the same table: a model change is compared on the same runs. A folder
    without its runs is refused."""
    work = tmp_path / "kept"

    def bench(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.whatif", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        return proc.stdout

    def table(out: str) -> list[str]:
        return [line for line in out.splitlines() if re.match(r"\s*(replay|1|64)\s+[\d.]+\s", line)]

    first = bench("--smoke", "--work", str(work))
    assert PRINTS["whatif"] in first  # its smoke run, as every other script's above
    kept = {p.relative_to(work): p.stat().st_mtime_ns for p in work.rglob("*")}
    assert {p.name for p in work.iterdir() if p.is_dir()} == {"mlp-r0-base", "mlp-r0-1", "mlp-r0-64"}
    again = bench("--from", str(work))
    assert len(table(first)) == 3 and table(again) == table(first)
    assert "predicted again from the runs kept in" in again
    assert {p.relative_to(work): p.stat().st_mtime_ns for p in work.rglob("*")} == kept
    empty = subprocess.run([sys.executable, "-m", "benchmarks.whatif", "--from", str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode != 0 and "no runs of this benchmark" in empty.stderr


def test_deepspeed_overhead_is_measured_under_zero_offload_and_refuses_parameter_offload_below_stage_3():
    """``benchmarks.deepspeed --offload both`` measures the tracer on a ZeRO-3 engine that
    offloads its optimizer states and parameters to the CPU (its header says so, its
    table has the stage's rows); asked below stage 3 it is one line and exit code 2."""
    pytest.importorskip("deepspeed")
    bad = smoke("deepspeed", "--offload", "both", "--stages", "2,3")
    assert bad.returncode == 2 and "only ZeRO stage 3 does: add --stages 3" in bad.stderr
    assert "Traceback" not in bad.stderr
    proc = smoke("deepspeed", "--offload", "both", "--stages", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-Offload to cpu: offload_optimizer and offload_param" in proc.stdout
    assert "the engines say they offload to: stage 3 optimizer cpu, parameters cpu" in proc.stdout  # DeepSpeed's own
    assert re.search(r"^\s+3 traced\s+[\d.]+\s+[\d.]+", proc.stdout, re.M), proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr
