"""The collectives outside the buckets (tracer/capture/collective_timer.py): a script's own
all-reduce and DDP's all-reduce of ``delay_all_reduce_named_params``, recorded in their
step on their own lane, named for who issued them, never buckets; the buckets stay the
layout DDP itself rebuilt (``_get_ddp_logging_data``). Real 2-rank gloo jobs."""

from __future__ import annotations

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.collective_timer import TORCH_CALLS
from ddpscope.viz.run_files import read_rank_file
from ddpscope.viz.trace import load_run
from tests.tracer.capture.autotrace.test_autotrace import USER, checks, trace_script
from tests.tracer.capture.ddp.test_compiled import built  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.ddp
STEPS = 4


@pytest.mark.parametrize("capture", ["compiled", pytest.param("python", marks=pytest.mark.breadth)])
def test_the_scripts_and_ddps_other_collectives_are_their_own_never_buckets(tmp_path, built, capture):  # noqa: F811
    """The script averages its loss after backward (4 bytes, one a step) with torch's
    functional all-reduce (DTensor's kind: it returns at once and is waited for when the
    script reads the mean; ``dist.all_reduce``'s is in test_own_collectives.py); DDP all-reduces the two delayed parameters' gradients itself (its
    ``_delay_grad_buffer``, one a step). Each is an event of its step on the lane of
    collectives outside the buckets, named for who issued it, with its bytes (the
    script's own count); the summary counts them; the buckets are DDP's rebuilt layout,
    byte for byte, without the delayed parameters. (Not compared with an untraced run:
    on gloo DDP never waits for its delayed all-reduce, so the optimizer races it and two
    untraced runs differ; the loss all-reduce alone is checked bit-identical in
    test_compiled.py.)"""
    script = (USER, "--steps", str(STEPS), "--depth", "3", "--bucket-cap-mb", "0.25", "--loss-allreduce", "--functional",
              "--delay-allreduce", "2")
    proc, out, report = trace_script(tmp_path, *script, ddpscope=("--capture", capture))
    assert proc.returncode == 0, proc.stderr
    trace, ddp = load_run(out), checks(report)
    assert trace.run["capture_path"] == capture and trace.status == "complete"
    delayed = ddp[0]["delayed_bytes"]
    assert delayed == 384 * 384 * 4 + 384 * 4  # the first layer's weight and bias, float32
    rebuilt = [[int(i) for i in b.split()] for b in ddp[0]["rebuilt"].split(",")]
    assert trace.run["bucket_layout"] == rebuilt and "0.weight" not in trace.run["param_names"]
    sizes = sorted(sum(trace.run["param_bytes"][i] for i in b) for b in rebuilt)
    for r in (0, 1):
        b = trace.buckets[(trace.buckets["rank"] == r) & (trace.buckets["step"] >= 1)]
        for _, one in b.groupby("step"):
            assert sorted(one["bytes"]) == sizes  # neither the loss nor the delayed gradients
        _, events = read_rank_file(out / fmt.rank_file(r))
        own = [e for e in events if e.get("cat") == fmt.CAT_DDP_OWN]
        script_ = [e for e in own if e["name"].startswith("all_reduce (the script, user_train.py:")]
        ddps = [e for e in own if e["name"] == TORCH_CALLS[("torch.nn.parallel.distributed", "_delayed_all_reduce_hook")]]
        assert len(own) == len(script_) + len(ddps), [e["name"] for e in own]
        assert sorted(e["args"]["step"] for e in script_) == list(range(STEPS))
        assert sorted(e["args"]["step"] for e in ddps) == list(range(STEPS))
        assert {e["args"]["bytes"] for e in script_} == {4} and {e["args"]["bytes"] for e in ddps} == {delayed}
        assert all(e["dur"] >= 0 for e in own) and not any("incomplete" in e["args"] for e in script_)
        # the script's is waited for inside its step; DDP's may still run when the step closes
        # (nothing waits for it): it ends when its future completes, or is incomplete
        assert all(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for e in script_ for s in events
                   if s.get("cat") == fmt.CAT_STEP and s["args"]["step"] == e["args"]["step"])
        steps = trace.steps[trace.steps["rank"] == r]
        assert steps["other_comm_count"].tolist() == [2] * STEPS
        assert steps["other_comm_bytes"].tolist() == [4 + delayed] * STEPS
        assert steps["ddp_own_bytes"].isna().all()  # no unused-parameter map
        assert (steps["other_comm_start_us"] >= steps["start_us"]).all()
