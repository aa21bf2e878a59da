"""The Run page (dashboard/run_page.py, dashboard/job_controls.py) with AppTest: reruns of the
open trace with another bucket setting and new commands, run for real and shown beside
their source; what it refuses, and when commands are off."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from ddpscope.tracer.launch.lab import lab_leftovers, why_not
from tests.conftest import ROOT, SAMPLES, run_cli
from tests.dashboard.app_driver import chart_specs, open_page, script_run, wait_for_job


def test_ddps_default_and_25_mib_everywhere_are_two_choices_on_the_run_page(tmp_path, monkeypatch):
    """A run traced at DDP's default (25 MiB, the first bucket 1 MiB) reruns as it was by
    default, not as "bucket_cap_mb = 25" (which caps the first bucket at 25 too); turning
    the default off offers the explicit cap; a run traced at an explicit cap starts off."""
    runs = tmp_path / "runs"
    shutil.copytree(SAMPLES / "gpt-2rank-cap25mb", runs / "dflt")
    r = json.loads((runs / "dflt" / "run.json").read_text())
    r.update(bucket_cap_default=True, first_bucket_cap_bytes=2**20)
    (runs / "dflt" / "run.json").write_text(json.dumps(r))
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert at.sidebar.selectbox(key="trace").value == "run: dflt"
    open_page(at, "Run")
    assert at.toggle(key="run_cap_default").value and at.select_slider(key="run_cap").disabled
    assert at.button(key="run_button").label == "Rerun with DDP's default buckets"
    at.toggle(key="run_cap_default").set_value(False).run()
    assert at.button(key="run_button").label == "Rerun with bucket_cap_mb = 25"
    at.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap1mb").run()
    assert not at.exception and not at.toggle(key="run_cap_default").value
    assert at.button(key="run_button").label == "Rerun with bucket_cap_mb = 1"


def test_the_chosen_setting_is_said_where_the_users_code_sets_it(tmp_path, monkeypatch):
    """A run the Hugging Face Trainer built (run.json's ``ddp_built_by``): the Run page says
    how TrainingArguments takes the chosen cap, and that it takes no list."""
    runs = tmp_path / "runs"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", runs / "hf")
    r = json.loads((runs / "hf" / "run.json").read_text())
    r["ddp_built_by"] = {"framework": "transformers", "module": "accelerate.accelerator", "file": "/x/accelerator.py",
                         "line": 1, "function": "prepare_model"}
    (runs / "hf" / "run.json").write_text(json.dumps(r))
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = open_page(AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run(), "Run")
    said = [c.value for c in at.caption if c.value.startswith("In your code: ")]
    assert said == ["In your code: TrainingArguments(ddp_bucket_cap_mb=1), or --ddp_bucket_cap_mb 1 on the command "
                    "line: to keep it once the rerun says it is worth it."]
    at.text_input(key="run_cap_list").input("1,8").run()
    said = next(c.value for c in at.caption if c.value.startswith("In your code: "))
    assert "passes one bucket_cap_mb to DDP and no bucket_cap_mb_list" in said and "--bucket-cap-mb-list 1,8" in said


@pytest.mark.ddp
def test_rerun_of_the_open_trace_shows_it_beside_its_source(app, tmp_path):
    """The open trace (the 1 MiB demo sample) rerun at 25 MiB from the Run page: progress
    where the user clicked, then both runs side by side with no picking."""
    assert app.sidebar.selectbox(key="trace").value == "sample: gpt-2rank-cap1mb"
    open_page(app, "Run")
    app.select_slider(key="run_cap").set_value(25.0)
    app.slider(key="run_steps").set_value(4)
    app.button(key="run_button").click().run()
    assert app.get("progress"), "no progress shown"
    assert app.button(key="run_button").disabled  # a second click cannot start a second job
    wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and f"run: {runs[0].name}" in app.sidebar.selectbox(key="trace").options
    table = [d.value for d in app.dataframe if "step_ms_vs_first" in d.value.columns][-1]
    assert list(table["run"]) == ["sample: gpt-2rank-cap1mb", f"run: {runs[0].name}"]
    assert list(table["bucket_cap_mb"]) == [1.0, 25.0] and table["buckets"].iloc[0] > table["buckets"].iloc[1]
    pair = [c for c in chart_specs(app) if "gpt-2rank-cap1mb: step" in json.dumps(c["layout"].get("title"))
            or f"{runs[0].name}: step" in json.dumps(c["layout"].get("title"))]
    assert len(pair) >= 2 and pair[-1]["layout"]["xaxis"]["range"] == pair[-2]["layout"]["xaxis"]["range"]
    layouts = [d.value for d in app.dataframe if list(d.value.columns)[:3] == ["bucket", "mib", "num_params"]
               and "launch_offset_ms" not in d.value.columns]
    assert sorted(len(t) for t in layouts[-2:]) == [table["buckets"].iloc[1], table["buckets"].iloc[0]]
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["demo"] == "gpt" and run["bucket_cap_mb"] == 25.0 and run["status"] == "complete"


@pytest.mark.ddp
@pytest.mark.breadth
def test_a_run_from_the_page_and_its_command_from_the_cli_are_the_same_run(app, tmp_path):
    """The Run page's job (the warm launcher, inside the dashboard's process) and the command
    it wrote in run.json run from a shell (a cold torchrun): the same command, layout,
    conditions (threads, cores, nice) and steps, read by the comparison as the same job: a
    user comparing a page rerun with a CLI run compares settings, not launchers. Their step
    times side by side are a benchmark's (benchmarks/rerun.py, its "steps" for the warm
    launcher and a cold torchrun): beside CI's other lane a time here once read 34 % apart."""
    open_page(app, "Run")
    app.slider(key="run_steps").set_value(16)
    app.button(key="run_button").click().run()
    wait_for_job(app)
    page_dir = next(p for p in (tmp_path / "runs").iterdir() if p.name != "uploads")
    page_run = json.loads((page_dir / "run.json").read_text())
    cmd = shlex.split(page_run["command"])
    assert cmd[:2] == ["ddpscope", "run"] and page_run["status"] == "complete"
    cli_dir = tmp_path / "cli-run"
    cmd[cmd.index("--out") + 1] = str(cli_dir)
    proc = run_cli(*cmd[1:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    cli_run = json.loads((cli_dir / "run.json").read_text())
    def but_out(command: str) -> list[str]:
        words = shlex.split(command)
        return words[:words.index("--out") + 1] + words[words.index("--out") + 2:]

    assert but_out(cli_run["command"]) == but_out(page_run["command"])
    assert cli_run["conditions"] == page_run["conditions"]
    assert cli_run["conditions"]["torch_threads"] == 1  # 2 ranks on 2 cores: torchrun's one thread a rank
    assert cli_run["bucket_layout"] == page_run["bucket_layout"]
    from ddpscope.viz.ddp.compare import compute_run_comparison, differences_text
    from ddpscope.viz.trace import load_run

    table = compute_run_comparison({"page": load_run(page_dir), "cli": load_run(cli_dir)})
    assert not [s for s in differences_text(table) if "conditions" in s or "buckets differ" in s]
    assert table["same_job"].all() and table["steps"].nunique() == 1 and table["steps"].iloc[0] >= 15, \
        table.to_string()


@pytest.mark.ddp
def test_a_rerun_with_a_size_per_bucket_checks_the_list_then_runs_it(app, tmp_path):
    open_page(app, "Run")
    app.text_input(key="run_cap_list").set_value("0.5,x").run()
    app.button(key="run_button").click().run()
    assert not app.exception and not app.get("progress")
    assert any("--bucket-cap-mb-list must be sizes in MiB separated by commas" in e.value for e in app.error)
    assert not [p for p in (tmp_path / "runs").glob("*") if p.name != "uploads"]
    app.text_input(key="run_cap_list").set_value("0.5,2").run()
    assert app.button(key="run_button").label == "Rerun with bucket_cap_mb_list = 0.5,2"
    app.slider(key="run_steps").set_value(3)
    app.button(key="run_button").click().run()
    wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["bucket_cap_bytes_list"] == [2**19, 2**21]
    assert run["bucket_cap_mb_list_requested"] == [0.5, 2.0] and "--bucket-cap-mb-list 0.5,2" in run["command"]


@pytest.mark.ddp
@pytest.mark.lab
@pytest.mark.skipif(why_not() is not None, reason=f"no emulated nodes here: {why_not()}")
def test_a_rerun_on_emulated_nodes_runs_across_the_shaped_links(app, tmp_path):
    open_page(app, "Run")
    app.toggle(key="run_lab").set_value(True).run()
    app.select_slider(key="run_lab_link").set_value("200mbit")
    app.slider(key="run_nproc").set_value(1)
    app.slider(key="run_steps").set_value(3)
    app.button(key="run_button").click().run()
    wait_for_job(app)
    assert not app.exception
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["world_size"] == 2
    assert run["emulation"]["nodes"] == 2 and run["emulation"]["link"] == "200mbit"
    assert not lab_leftovers()


@pytest.mark.ddp
def test_a_failed_rerun_shows_the_rank_and_reason_not_a_traceback(app, monkeypatch):
    monkeypatch.setenv("DDPSCOPE_TEST_FAIL", "1:1")
    open_page(app, "Run")
    app.slider(key="run_steps").set_value(3)
    app.button(key="run_button").click().run()
    wait_for_job(app)
    assert not app.exception
    assert any("failed: rank 1 failed: RuntimeError: injected failure" in e.value for e in app.error)
    assert "Traceback" in app.code[-1].value  # the rank's stderr tail, shown as text
    app.sidebar.selectbox(key="trace").set_value("sample: mlp-2rank-cap1mb").run()  # the page keeps working
    assert not app.exception


@pytest.mark.ddp
def test_a_new_command_is_checked_before_it_starts_then_runs(app, tmp_path):
    open_page(app, "Run")
    app.text_input(key="new_cmd").set_value("missing.py --lr 3")
    app.text_input(key="new_cwd").set_value(str(tmp_path))
    app.button(key="new_button").click().run()
    assert not app.exception and not app.get("progress")
    assert any(e.value == f"script missing.py does not exist (in {tmp_path})" for e in app.error)
    assert not [p for p in (tmp_path / "runs").glob("*") if p.name != "uploads"]
    script = ROOT / "tests" / "workers" / "user_train.py"
    app.text_input(key="new_cmd").set_value(f"{script} --steps 4 --report {tmp_path / 'report'}")
    app.button(key="new_button").click().run()
    wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and runs[0].name.split("-")[2] == "user_train"
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["script"]["cwd"] == str(tmp_path) and run["steps"] == 4
    assert (tmp_path / "report" / "check-rank1.json").exists()


def test_commands_are_off_when_the_page_is_reachable_from_other_machines(app, tmp_path, monkeypatch):
    script_run(tmp_path / "runs" / "mine", ["tests/workers/user_train.py", "--steps", "3"])
    open_page(app, "Run")
    app.sidebar.selectbox(key="trace").set_value("run: mine").run()
    assert not app.button(key="run_button").disabled and not app.button(key="new_button").disabled
    assert "user_train.py --steps 3" in app.code[0].value
    st_config.set_option("server.address", "0.0.0.0")
    try:
        app.run()
        assert any("reachable from other machines" in i.value for i in app.info)
        assert app.button(key="run_button").disabled and app.button(key="new_button").disabled
        assert app.text_input(key="new_cmd").disabled
        app.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap1mb").run()
        assert not app.button(key="run_button").disabled  # the demo is not an arbitrary command
        monkeypatch.setenv("DDPSCOPE_ALLOW_COMMANDS", "1")
        app.run()
        assert not app.button(key="new_button").disabled
        assert any("--allow-commands" in w.value for w in app.warning)
    finally:
        st_config.set_option("server.address", "127.0.0.1")


def test_an_uploaded_script_run_is_not_rerun(app, tmp_path):
    script_run(tmp_path / "runs" / "uploads" / "theirs", ["train.py"])
    open_page(app, "Run")
    app.sidebar.selectbox(key="trace").set_value("upload: theirs").run()
    assert app.button(key="run_button").disabled
    assert any("uploaded" in i.value for i in app.info)


@pytest.mark.ddp
@pytest.mark.breadth
def test_a_click_from_a_page_drawn_before_a_run_began_is_answered_not_dropped(app, tmp_path):
    """Two tabs: the second was drawn while nothing ran (its Run button enabled). Its
    click while the first tab's run goes on says so, and starts nothing."""
    slow = tmp_path / "slow.py"  # a job that surely outlasts the second click (no DDP: nothing traced)
    slow.write_text("import time\ntime.sleep(20)\n")
    other = open_page(AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run(), "Run")
    assert not other.button(key="run_button").disabled
    open_page(app, "Run")
    app.text_input(key="new_cmd").input(str(slow))
    app.button(key="new_button").click().run()
    assert app.get("progress") and app.button(key="run_button").disabled
    other.button(key="run_button").click().run()
    assert any("A run is already going" in i.value for i in other.info)
    wait_for_job(app)
    assert len([p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]) == 1
