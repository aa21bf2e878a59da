"""The peak of a DeepSpeed run at another reduce_bucket_size (viz/sharded/deepspeed_states.py,
``predict_deepspeed_peak``), against the rerun at that size: real 2-rank DeepSpeed jobs (CPU
accelerator, gloo), the rerun made as the Run page makes it (``ddpscope run --bucket-cap-mb``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from ddpscope.viz.sharded.metrics import compute_memory_over_step, compute_sharded_run_comparison
from ddpscope.viz.sharded.predict import predict_deepspeed_peak
from ddpscope.viz.trace import load_run
from tests.conftest import ROOT, run_cli
from tests.tracer.capture.autotrace.test_autotrace import trace_script

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed]
WORKER = str(ROOT / "tests" / "workers" / "deepspeed_train.py")
ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.parametrize("stage", [2, 3])
def test_the_peak_at_another_reduce_bucket_size_is_the_reruns_to_the_byte(tmp_path, stage):
    """Traced at 20,000 elements, predicted at 0.5 MiB (131,072 fp32 elements), rerun there: the
    rerun's peak per rank is the prediction, to the byte. ZeRO-3 allocates its bucket whole, so
    its peak grows by the bucket's growth; these stage-2 runs hold no bucket buffer when memory
    is sampled, so their peak stays."""
    script = (WORKER, "--stage", str(stage), "--steps", "3", "--reduce-bucket-size", "20000")
    proc, out, _ = trace_script(tmp_path, *script, name="traced", env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, again, _ = trace_script(tmp_path, *script, ddpscope=("--bucket-cap-mb", "0.5"), name="rerun", env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    traced, rerun = load_run(out), load_run(again)
    assert traced.run["deepspeed"]["reduce_bucket_bytes"] == 4 * 20_000
    assert rerun.run["deepspeed"]["reduce_bucket_bytes"] == 2**19  # the page's 0.5 MiB, as DeepSpeed ran it

    table = predict_deepspeed_peak(traced, 2**19).set_index("rank")
    measured = {r: compute_memory_over_step(rerun, r)["total_bytes"].max() for r in (0, 1)}
    assert table["predicted_peak_bytes"].to_dict() == measured
    grew = table["predicted_peak_bytes"] - table["measured_peak_bytes"]
    assert (grew == (2**19 - 80_000) if stage == 3 else grew == 0).all(), grew
    # the Compare table set beside the rerun on the page says which size each ran with, and the
    # rerun's peak there is the one predicted (its largest rank's)
    table_ab = compute_sharded_run_comparison({"traced": traced, "rerun": rerun}).set_index("run")
    assert table_ab["reduce_bucket_MiB"].tolist() == [80_000 / 2**20, 0.5]
    assert table_ab.loc["rerun", "peak_MiB"] * 2**20 == pytest.approx(table["predicted_peak_bytes"].max(), rel=1e-12)
    # `ddpscope whatif --caps` prints it (the page's prediction) beside the run as measured
    said = run_cli("whatif", str(out), "--caps", "0.5,16", "--json")
    assert said.returncode == 0, said.stderr
    peaks = pd.DataFrame(json.loads(said.stdout)["bucket_peaks"])
    assert peaks["reduce_bucket_MiB"].drop_duplicates().tolist() == [80_000 / 2**20, 0.5, 16.0]
    at_half = peaks[peaks["reduce_bucket_MiB"] == 0.5].set_index("rank")
    assert at_half["predicted"].all() and at_half["peak_bytes"].to_dict() == measured
    own_row = peaks[~peaks["predicted"]].set_index("rank")["peak_bytes"]
    assert own_row.to_dict() == table["measured_peak_bytes"].to_dict()
    # at its own size, the prediction is the run
    own = predict_deepspeed_peak(traced, 80_000)
    assert (own["predicted_peak_bytes"] == own["measured_peak_bytes"]).all()

    # bad input: one line, no table
    with pytest.raises(ValueError, match="must be > 0 bytes"):
        predict_deepspeed_peak(traced, 0)
    untold = replace(traced, run={**traced.run, "deepspeed": {}}, cache={})
    with pytest.raises(ValueError, match="did not record DeepSpeed's reduce_bucket_size"):
        predict_deepspeed_peak(untold, 2**19)
