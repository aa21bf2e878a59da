"""The step recorder's gradient marks under ``--grad-marks-every``: every parameter's on
the first steps and every Nth, one stamp (where backward compute ends) on the others,
on both capture paths (the Python one's runs in the breadth suite), run for real
(``ddpscope run``, 2 gloo ranks, gradient accumulation) and read back as a user's dashboard
reads it."""

from __future__ import annotations

import json

import pytest

from ddpscope.tracer.capture.ddp.recorder import GRAD_MARKS_FIRST_STEPS
from ddpscope.tracer.launch.torchrun import LaunchConfig, launch
from ddpscope.viz.trace import load_run
from ddpscope.viz.whatif.advisor import unused_parameters
from ddpscope.viz.whatif.model import fit_model, step_inputs
from ddpscope.viz.whatif.simulate import predict_run, traced_cap
from tests.conftest import ROOT, run_cli, workers_env
from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

pytestmark = pytest.mark.ddp
EVERY, STEPS = 3, 12


@pytest.mark.parametrize("capture", ["compiled", pytest.param("python", marks=pytest.mark.breadth)])
def test_steps_between_marked_ones_keep_their_spans_and_compute_end_and_no_marks(tmp_path, capture, monkeypatch):
    script = (USER, "--steps", str(STEPS), "--accumulate", "2", "--bucket-cap-mb", "1")
    proc, out, _ = trace_script(tmp_path, *script, ddpscope=("--grad-marks-every", str(EVERY), "--capture",
                                                                  capture))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = load_run(out)
    assert trace.run["grad_marks_every"] == EVERY and f"--grad-marks-every {EVERY}" in trace.run["command"]
    assert trace.run["capture_path"] == capture
    marked = {s for s in range(STEPS) if s < GRAD_MARKS_FIRST_STEPS or s % EVERY == 0}
    steps = trace.steps
    assert set(steps["step"]) == set(range(STEPS))
    assert set(steps[steps["grad_marks"]]["step"]) == marked  # the same steps on both ranks
    assert (steps.groupby("step")["grad_marks"].nunique() == 1).all()
    n = len(trace.run["param_names"])
    for (rank, step), g in trace.grads.groupby(["rank", "step"]):
        assert step in marked
        assert sorted(g.groupby("micro")["param"].nunique()) == [n, n]  # both micro-batches, every parameter
    assert {int(s) for s in trace.grads["step"]} == marked
    # every step keeps its backward's compute end: the last gradient of its syncing pass
    # (marked: their mark; the others: the one stamp they kept)
    assert steps["compute_end_us"].notna().all()
    assert ((steps["compute_end_us"] > steps["backward_start_us"])
            & (steps["compute_end_us"] <= steps["backward_end_us"] + 1e-3)).all()
    last = trace.grads[trace.grads["micro"] == 1].groupby(["rank", "step"])["ready_us"].max()
    on_marked = steps[steps["grad_marks"]].set_index(["rank", "step"])["compute_end_us"]
    assert (on_marked - last.reindex(on_marked.index)).abs().max() < 1.0  # µs
    # the same bucket all-reduces on every step, marked or not
    assert trace.buckets[trace.buckets["step"] >= 1].groupby(["rank", "step"]).size().nunique() == 1
    # the what-if replays the marked steps, and a step without marks does not make every parameter "unused"
    assert unused_parameters(trace) == []
    model = fit_model(trace)
    assert {s.step for s in step_inputs(trace, model)} <= marked
    predicted = predict_run(trace, traced_cap(trace), model)
    assert set(predicted.steps["step"]) <= marked and len(predicted.steps)
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0 and f"gradient marks on 1 step in {EVERY}" in summary.stdout.splitlines()[0]
    assert json.loads(run_cli("summary", str(out), "--json").stdout)["grad_marks_every"] == EVERY
    if capture == "compiled":  # the page says why most steps have no marks, and the What-if page replays the rest
        from streamlit.testing.v1 import AppTest

        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / "marks").symlink_to(out)
        monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
        at.sidebar.selectbox(key="trace").set_value("run: marks").run()
        assert not at.exception and not at.error
        assert any(f"--grad-marks-every {EVERY}" in c.value for c in at.caption)
        at.session_state["page"] = "What-if"
        at.run()
        assert not at.exception and not at.error and len(at.dataframe)


@pytest.mark.parametrize("capture", ["compiled", pytest.param("python", marks=pytest.mark.breadth)])
def test_a_step_without_marks_stamps_one_gradient_and_training_is_unchanged(tmp_path, capture):
    """What makes the marks cheap to leave out: a step without them stamps one gradient
    (the C++ hooks on the compiled path, the Python hooks on the other), the one ready
    last in the latest marked step; the parameters end bit-identical to an untraced copy."""
    out = tmp_path / "check"
    result = launch(LaunchConfig(
        target="tests.workers.ddp_check", nproc=2, log_dir=out / "logs", timeout_s=180, env=workers_env(),
        args=["--out", str(out), "--steps", str(STEPS), "--compare-untraced", "--grad-marks-every", str(EVERY),
              "--capture", capture]))
    assert result.ok, f"{result.reason}\n{result.stderr_tail}"
    for rank in (0, 1):
        check = json.loads((out / f"check-rank{rank}.json").read_text())
        assert check["params_bitwise_equal"]
        stamped = {int(k): v for k, v in check["stamped"].items()}
        assert sorted(stamped) == list(range(STEPS))
        n = len(load_run(out / "trace").run["param_names"])
        last = None
        for step in range(STEPS):
            if step < GRAD_MARKS_FIRST_STEPS or step % EVERY == 0:
                assert sorted(stamped[step]) == list(range(n))
                last = stamped[step][-1]  # stamp order: the one ready last
            else:
                assert stamped[step] == [last], step
