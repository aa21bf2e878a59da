"""Runs started for the dashboard: one at a time, each in its own folder."""

import shutil
import time

import pytest

from ddpscope.tracer.launch.jobs import JobManager
from tests.conftest import SAMPLES

pytestmark = pytest.mark.ddp


def test_a_second_start_while_running_does_nothing_and_the_first_finishes(tmp_path):
    jobs = JobManager(tmp_path / "runs")
    first = jobs.start(demo="mlp", nproc=2, bucket_cap_mb=5.0, steps=3)
    assert first is not None and first.running
    assert jobs.start(demo="gpt", nproc=2, bucket_cap_mb=1.0, steps=3) is None
    deadline = time.monotonic() + 120
    while first.running and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.ok and first.steps_done == 3
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [first.out.name]
    assert (first.out / "rank-1.json").exists()
    with pytest.raises(ValueError, match="--bucket-cap-mb"):
        jobs.start(demo="mlp", nproc=2, bucket_cap_mb=0.0, steps=3)


def test_one_job_at_a_time_across_kinds_and_ring_progress(tmp_path):
    jobs = JobManager(tmp_path / "runs")
    ring = jobs.start_ring(nproc=2, mb=0.25, repeat=2)
    assert ring is not None and ring.kind == "ring" and ring.total == 2
    assert jobs.start_zero(model="mlp", nproc=2) is None  # the ring is still going
    deadline = time.monotonic() + 120
    while ring.running and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ring.ok and ring.done == 2 and ring.out.name.endswith("-ring-2r-0.25mb")
    with pytest.raises(ValueError, match="--stages"):
        jobs.start_zero(model="mlp", nproc=2, stages="5")
    with pytest.raises(ValueError, match="a ring needs two ranks: give --nproc 2 or more, or --emulate-nodes 2"):
        jobs.start_ring(nproc=1, mb=1.0, repeat=1)


def test_a_calibration_writes_into_the_run_it_calibrates_and_counts_its_sizes(tmp_path):
    """``ddpscope calibrate`` from the dashboard: no new folder, the run's own gets
    ``calibration.json``, which the what-if then reads (the sample's buckets are all ~1 MiB:
    before it, nothing measured a fixed cost per all-reduce); progress is the sizes swept
    (4 KiB x 4 up to 1 MiB: 5) and the contention phase."""
    from ddpscope.viz.trace import load_run
    from ddpscope.viz.whatif.cost import read_calibration
    from ddpscope.viz.whatif.model import fit_model

    run = tmp_path / "runs" / "mlp"
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", run)
    assert not fit_model(load_run(run)).cost.latency_fitted
    jobs = JobManager(tmp_path / "runs")
    job = jobs.start_calibrate(run=run, max_mb=1.0)
    assert job is not None and job.kind == "calibrate" and job.out == run and job.unit == "size"
    assert jobs.start(demo="mlp", nproc=2, bucket_cap_mb=1.0, steps=3) is None  # one job at a time
    deadline = time.monotonic() + 120
    while job.running and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.ok, job.error or job.result.reason
    assert (job.done, job.total) == (6, 6)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["mlp"]
    cal = read_calibration(run)
    assert cal is not None and [int(b) for b in cal.sizes] == [4096, 16384, 65536, 262144, 2**20]
    assert (cal.backend, cal.meta["device"]) == ("gloo", "cpu")  # the run's own
    model = fit_model(load_run(run))
    assert model.cost.latency_fitted and "calibration" in model.cost.source
    with pytest.raises(ValueError, match="not a run folder"):
        jobs.start_calibrate(run=tmp_path)


def test_settle_waits_for_a_job_past_its_last_step_to_end_once_and_never_before(tmp_path):
    """What the page calls before drawing a job: past its last step, the job's end is
    waited for (the page then shows the finished run at once, not a refresh later)."""
    jobs = JobManager(tmp_path / "runs")
    job = jobs.start(demo="mlp", nproc=2, bucket_cap_mb=5.0, steps=3)
    assert job is not None
    job.settle(timeout_s=60)  # steps not all done yet: returns at once, and may wait later
    assert not job.settled
    deadline = time.monotonic() + 120
    while job.running and job.done < job.total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.running, "the job ended before its finishing could be seen"  # rank 0 reports its last step first
    job.settle(timeout_s=60)
    assert job.settled and job.ended.is_set() and not job.running and job.ok
    job.settle(timeout_s=60)  # ended: nothing to wait for


def test_settle_waits_for_a_job_its_pace_says_ends_before_the_next_refresh(tmp_path):
    """Steps left at the last step's pace: done before the page's next refresh, so waited
    for (once); not before then."""
    jobs = JobManager(tmp_path / "runs")
    job = jobs.start(demo="mlp", nproc=2, bucket_cap_mb=5.0, steps=6)
    assert job is not None
    deadline = time.monotonic() + 120
    while job.running and not (job.done >= 1 and job.last_ms) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.running and job.done < job.total, "the job ended before its pace could be seen"
    job.settle(before_s=0.0)  # steps left, no time to do them: no wait
    assert not job.settled
    job.settle(before_s=600.0, timeout_s=60)  # done long before that at its pace: waited for
    assert job.settled and job.ended.is_set() and not job.running and job.ok
