"""``ddpscope run --profile`` on FSDP2: the tracer's all-gathers and reduce-scatters
against torch.profiler's on the same real run (2 ranks, gloo), collective by collective."""

from __future__ import annotations

import dataclasses

import pytest

from ddpscope.viz.sharded.profile_check import COLUMNS, compute_sharded_profile_agreement
from ddpscope.viz.sources.run_profile import load_run_profile
from ddpscope.viz.trace import load_run
from tests.tracer.capture.autotrace.test_autotrace import WORKERS, trace_script

pytestmark = pytest.mark.ddp

TOL_MS = 0.05  # the two clocks' offset, sampled once when the profiler started


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2-profiled")
    proc, out, _ = trace_script(tmp, str(WORKERS / "fsdp2_train.py"), "--steps", "4",
                                ddpscope=("--profile", "--profile-steps", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = load_run(out)
    return trace, load_run_profile(trace)


def test_every_collective_the_tracer_timed_is_the_profilers_of_the_same_bytes_inside_its_span(profiled):
    """Every all-gather and reduce-scatter (gloo: run as an all-reduce) of the profiled
    steps, matched in order: the profile's input bytes are the shard (an all-gather's
    gathered bytes over its shard group) or the whole; gloo ran each inside the span the
    tracer gave it (it queues after the call, ends before the tracer sees its end)."""
    trace, profile = profiled
    a = compute_sharded_profile_agreement(trace, profile)
    assert sorted(a["rank"].unique()) == [0, 1] and sorted(a["step"].unique()) == [1, 2]
    assert not a[["tracer_bytes", "profile_bytes", "start_us", "profile_start_us"]].isna().any().any(), a
    units = len(trace.shards.units)
    counts = a.groupby(["rank", "step", "collective"]).size().unstack()
    assert (counts["allgather"] == 2 * units).all() and (counts["allreduce"] == units).all(), counts
    assert (a["profile_bytes"] == a["expected_profile_bytes"]).all(), a
    gathers = a[a["collective"] == "allgather"]
    assert (gathers["profile_bytes"] * 2 == gathers["tracer_bytes"]).all()  # a shard of 2
    assert (a["start_after_ms"] >= -TOL_MS).all(), a.sort_values("start_after_ms").head()
    assert (a["end_before_ms"] >= -TOL_MS).all(), a.sort_values("end_before_ms").head()
    # each unit's collective, in the order the tracer saw them
    assert list(a[(a["rank"] == 0) & (a["step"] == 1)]["name"].iloc[:units]) == list(trace.shards.units["name"])


def test_a_run_that_is_not_sharded_or_a_profile_of_other_steps_gives_rows_the_check_can_tell(profiled, mlp_run):
    """A DDP run, or a rank without a profile: no rows; a profile of other steps: the
    tracer's rows, the profiler's side NaN (unmatched, not matched to the wrong ones)."""
    trace, profile = profiled
    ddp = load_run(mlp_run[0])
    assert compute_sharded_profile_agreement(ddp, profile).empty  # DDP: no units to compare
    # a profile whose steps are other steps than the trace's: nothing matched, said by NaN
    shifted = profile.kernels.assign(step=profile.kernels["step"] + 10)
    a = compute_sharded_profile_agreement(trace, dataclasses.replace(profile, kernels=shifted))
    assert len(a) and a["profile_start_us"].isna().all() and a["start_us"].notna().all()
    unprofiled = {r: {k: v for k, v in m.items() if k != "profile"} for r, m in trace.ranks.items()}
    assert compute_sharded_profile_agreement(dataclasses.replace(trace, ranks=unprofiled), profile).empty
    assert list(compute_sharded_profile_agreement(ddp, profile).columns) == COLUMNS
