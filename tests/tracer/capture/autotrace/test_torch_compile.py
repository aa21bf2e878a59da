"""DDP under ``torch.compile`` (nanoGPT compiles by default): traced as any DDP model, the
compile recorded in run.json, and never a bucket cap its DDPOptimizer refuses (under
1 MiB, an AssertionError at the first forward): not applied where ddpscope can see the
compiled module before DDP is built, explained where it cannot (``torch.compile(DDP(m))``),
never offered by the what-if. Real runs: 2 ranks on gloo, inductor on the CPU."""

from __future__ import annotations

import json

import pytest

from ddpscope.viz.trace import load_run
from ddpscope.viz.whatif.advisor import advise
from ddpscope.viz.whatif.layout import runnable
from ddpscope.viz.whatif.sweep import compute_cap_sweep
from tests.conftest import ROOT, run_cli
from tests.tracer.capture.autotrace.test_autotrace import trace_script, untraced

pytestmark = pytest.mark.ddp
SCRIPT = str(ROOT / "tests" / "workers" / "compiled_train.py")
REFUSED = "torch.compile's DDPOptimizer refuses a bucket cap under 1 MiB"


def sha(report, rank: int) -> str:
    return json.loads((report / f"rank{rank}.json").read_text())["params_sha256"]


def compiled(report, rank: int) -> dict:
    """What torch.compile made of the script on ``rank``: ``unique_graphs``, ``calls_captured``."""
    return json.loads((report / f"rank{rank}.json").read_text())["compiled"]


@pytest.mark.breadth  # the default suite keeps a compiled run traced and a refused cap explained
def test_a_compiled_model_keeps_its_caps_where_the_asked_one_would_fail_and_the_whatif_offers_none(tmp_path):
    proc, out, report = trace_script(tmp_path, SCRIPT, ddpscope=("--bucket-cap-mb", "0.5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("--bucket-cap-mb 0.5 is not applied: the model is torch.compile'd") == 1
    run = json.loads((out / "run.json").read_text())
    assert run["bucket_cap_mb"] == 25.0 and run["bucket_cap_bytes"] == 25 * 2**20  # the script's (DDP's default)
    assert run["torch_compile"]["inside"] is True and run["torch_compile"]["optimize_ddp"] == "ddp_optimizer"
    assert run["torch_compile"]["graphs"] >= 1
    summary = run_cli("summary", str(out))  # the run says it was compiled, as run.json does
    assert summary.returncode == 0 and "bucket_cap_mb=25  torch.compile'd (optimize_ddp=ddp_optimizer)" in summary.stdout
    assert json.loads(run_cli("summary", str(out), "--json").stdout)["torch_compile"] == run["torch_compile"]
    plain = untraced(tmp_path, SCRIPT)
    assert [sha(report, r) for r in (0, 1)] == [sha(plain, r) for r in (0, 1)]  # traced, bit-identical
    assert [compiled(report, r) for r in (0, 1)] == [compiled(plain, r) for r in (0, 1)]  # the same graphs
    trace = load_run(out)
    sweep = compute_cap_sweep(trace, (0.25, 0.5, 1.0, 4.0), lists=[(0.25, 0.5)])
    assert set(sweep["bucket_cap_mb"]) == {1.0, 4.0, 25.0} and sweep["bucket_cap_mb_list"].isna().all()
    assert REFUSED.replace("torch.compile's DDPOptimizer", "its DDPOptimizer") in sweep.attrs["note"]
    advice = advise(trace, sweep.attrs["model"], caps=(0.25, 0.5, 1.0, 4.0), local_budget=20)
    settings = list(advice.candidates["setting"])
    assert settings and all(runnable(trace.run, s) for s in settings)  # every one a cap DDPOptimizer takes
    assert not runnable(trace.run, 0.5) and not runnable(trace.run, (0.25, 0.5)) and runnable(trace.run, (0.1, 1.0))


def test_torch_compile_of_ddp_under_a_refused_cap_fails_saying_what_to_change(tmp_path):
    """``torch.compile(DDP(model))`` compiles after DDP is built: the cap is applied, the
    first forward fails as it would without ddpscope, and the last line says why."""
    proc, out, _ = trace_script(tmp_path, SCRIPT, "--outer", ddpscope=("--bucket-cap-mb", "0.5"))
    assert proc.returncode == 1
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("ddpscope run: run failed:"))
    assert "AssertionError: First bucket should be smaller/equal to other buckets" in line
    assert f"({REFUSED}, its first bucket: give DDP a bucket_cap_mb" in line


def test_torch_compile_of_ddp_is_recorded_once_it_compiled_and_compiles_as_untraced(tmp_path):
    """Compiling DDP itself, dynamo meets ddpscope's hooks on the DDP module: it cannot trace
    them (they read clocks), so they run as they are, outside every graph; the graphs and
    the calls captured in them are the untraced run's (a torch whose dynamo traced a hook
    into a graph would fail here), the parameters bit-identical."""
    proc, out, report = trace_script(tmp_path, SCRIPT, "--outer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, SCRIPT, "--outer")
    assert [compiled(report, r) for r in (0, 1)] == [compiled(plain, r) for r in (0, 1)]
    assert compiled(plain, 0)["unique_graphs"] >= 1 and compiled(plain, 0)["calls_captured"] >= 1
    assert [sha(report, r) for r in (0, 1)] == [sha(plain, r) for r in (0, 1)]
    fact = json.loads((out / "run.json").read_text())["torch_compile"]
    assert fact["inside"] is False and fact["graphs"] >= 1 and fact["optimize_ddp"] == "ddp_optimizer"
    assert load_run(out).steps.groupby("rank").size().to_dict() == {0: 4, 1: 4}
