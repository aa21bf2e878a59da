"""A job's capture session: every DDP model in the job is traced, each into a run folder
of its own (a GAN: generator and discriminator, each with its own Adam)."""

from __future__ import annotations

import json

import pytest

from ddpscope.viz.trace import load_run
from tests.conftest import run_cli
from tests.tracer.capture.autotrace.test_autotrace import WORKERS, trace_script, untraced

GAN = str(WORKERS / "gan_train.py")


# a second DDP model in the default suite: test_autotrace's GAN-like two-model run
@pytest.mark.breadth
@pytest.mark.parametrize("capture", ["compiled", "python"])
def test_every_ddp_model_of_a_gan_is_traced_with_its_own_buckets_and_folder(tmp_path, capture):
    proc, out, report = trace_script(tmp_path, GAN, "--steps", "5", ddpscope=("--capture", capture))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP model 1 (Discriminator) is traced too, into models/1-Discriminator" in proc.stderr
    main = load_run(out)
    assert main.run["models"] == [{"index": 0, "model": "Generator", "folder": "."},
                                  {"index": 1, "model": "Discriminator", "folder": "models/1-Discriminator"}]
    ddp = [json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)]
    for m in main.run["models"]:
        trace = load_run(out / m["folder"])
        assert trace.status == "complete" and trace.world_size == 2
        assert trace.run["capture_path"] == capture  # the second model's hooks are the first's
        # its layout is the one DDP rebuilt for this model, its buckets that layout's bytes each step
        rebuilt = [[int(i) for i in b.split()] for b in ddp[0][m["model"]]["rebuilt"].split(",")]
        assert trace.run["bucket_layout"] == rebuilt
        sizes = sorted(sum(trace.run["param_bytes"][i] for i in b) for b in rebuilt)
        for (rank, step), b in trace.buckets[trace.buckets["step"] >= 1].groupby(["rank", "step"]):
            passes = trace.passes[(trace.passes["rank"] == rank) & (trace.passes["step"] == step)]
            backwards = int(passes["backward_end_us"].notna().sum())
            assert sorted(b["bytes"]) == sorted(sizes * backwards), (m, rank, step)
        assert trace.steps.groupby("rank").size().min() >= 5  # one step per optimizer step of its own
    # the discriminator's steps are its Adam's, the generator's its own
    assert main.run["model_params"] != load_run(out / "models/1-Discriminator").run["model_params"]
    plain = untraced(tmp_path, GAN, "--steps", "5")
    for r in (0, 1):
        assert json.loads((plain / f"rank{r}.json").read_text()) == ddp[r]  # bit-identical, both models
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0 and "this job trained 2 DDP models" in summary.stdout
    whatif = run_cli("whatif", str(out / "models" / "1-Discriminator"), "--json")
    assert whatif.returncode == 0, whatif.stderr


def test_the_dashboard_lists_each_model_of_a_job(tmp_path, monkeypatch):
    """The picker shows a job's further models beside it, each a run of its own."""
    import shutil

    from ddpscope.dashboard import catalog
    from tests.conftest import SAMPLES

    runs = tmp_path / "runs"
    job = runs / "gan"
    (job / "models").mkdir(parents=True)
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", job, dirs_exist_ok=True)
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", job / "models" / "1-Discriminator")
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    found = catalog.list_runs()
    assert found["run: gan"][0] == job and found["run: gan · 1-Discriminator"][0] == job / "models" / "1-Discriminator"
    assert catalog.label_of(job / "models" / "1-Discriminator") == "run: gan · 1-Discriminator"
