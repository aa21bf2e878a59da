"""The Streamlit page with AppTest: each view, uploads, and the run flow (real runs)."""

from __future__ import annotations

import gzip
import io
import json
import os
import shlex
import shutil
import time
import zipfile

import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from ddpscope.tracer.launch.lab import lab_leftovers, why_not
from ddpscope.viz.sharded.metrics import NO_UNIT
from tests.conftest import KINETO, ROOT, SAMPLES, run_cli
from tests.viz.sources.test_kineto import gpu_profile

# element order on the page: dataframes
MEDIANS, PER_STEP, STRAGGLERS, BUCKETS = 0, 1, 2, 3


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    st_config.set_option("server.address", "127.0.0.1")  # as .streamlit/config.toml and `ddpscope dashboard`
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and not at.error
    return at


def _page(at, label: str):
    """Open one page of the dashboard (only the open page computes) and run."""
    at.session_state["page"] = label
    return at.run()


def _spec(at, n=0):
    return json.loads(at.get("plotly_chart")[n].proto.spec)


def _metric(at, label):
    return next(m.value for m in at.metric if m.label == label)


def _open_traced(tmp_path, monkeypatch, *script: str, name: str, **trace_kw):
    """``script`` traced by ``ddpscope run`` into ``tmp_path/runs/<name>`` (``trace_kw``:
    ``trace_script``'s ``ddpscope`` and ``env``), the dashboard opened on that runs folder:
    ``(AppTest, run folder)``, the page drawn without an error."""
    from tests.tracer.capture.autotrace.test_autotrace import trace_script

    runs = tmp_path / "runs"
    runs.mkdir()
    proc, out, _ = trace_script(runs, *script, name=name, **trace_kw)
    assert proc.returncode == 0, proc.stderr[-2000:]
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    return at, out


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_an_upload_cut_short_while_written_opens_as_the_steps_it_holds(app, mlp_run):
    """A rank file is written as it goes (format version 2: an event array): one cut short (a
    run killed while writing, a copy taken mid-run) is read up to its last whole event and
    the run shows as unfinished, saying which rank stopped where; nothing is refused, nothing
    raised. (A version-1 object cut short is refused: the trunc.zip case below.)"""
    files = {p.name: p.read_bytes() for p in mlp_run[0].iterdir() if p.name.endswith(".json")}
    assert files["rank-0.json"].startswith(b"[")
    files["rank-0.json"] = files["rank-0.json"][:5000]
    app.sidebar.file_uploader(key="upload").upload("cut.zip", _zip(files))
    app.run()
    assert not app.exception and not app.sidebar.error
    assert not app.sidebar.selectbox(key="trace").value.startswith("sample:")  # the upload is open
    notes = " ".join(w.value for w in app.warning)
    assert "the trace was not finished (rank 0 after step 0)" in notes, notes


def test_timeline_view_opens_on_a_sample_with_both_ranks(app):
    assert app.title[0].value == "ddpscope"
    medians = app.dataframe[MEDIANS].value
    assert list(medians["rank"]) == [0, 1] and (medians["step_ms"] > 0).all()
    spec = _spec(app)
    assert {"forward", "bucket all-reduce", "optimizer.step"} <= {t["name"] for t in spec["data"]}
    assert spec["layout"]["yaxis"]["ticktext"] == ["rank 0 · compute", "rank 0 · all-reduce",
                                                    "rank 1 · compute", "rank 1 · all-reduce"]


def test_switching_traces_ranks_and_steps(app):
    options = app.sidebar.selectbox(key="trace").options
    assert len(options) >= 3
    for name in options:
        app.sidebar.selectbox(key="trace").set_value(name).run()
        assert not app.exception and not app.error
        table = app.dataframe[BUCKETS].value
        assert len(table) == int(_metric(app, "buckets"))
        if _metric(app, "bucket_cap_mb (MiB)") == "1":
            assert len(table) >= 10
    app.multiselect(key="ranks").set_value([1]).run()
    assert _spec(app)["layout"]["yaxis"]["ticktext"] == ["rank 1 · compute", "rank 1 · all-reduce"]
    app.select_slider(key="steps").set_range(2, 5).run()
    assert not app.exception and app.select_slider(key="steps").value == (2, 5)


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
    _page(at, "Run")
    assert at.toggle(key="run_cap_default").value and at.select_slider(key="run_cap").disabled
    assert at.button(key="run_button").label == "Rerun with DDP's default buckets"
    at.toggle(key="run_cap_default").set_value(False).run()
    assert at.button(key="run_button").label == "Rerun with bucket_cap_mb = 25"
    at.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap1mb").run()
    assert not at.exception and not at.toggle(key="run_cap_default").value
    assert at.button(key="run_button").label == "Rerun with bucket_cap_mb = 1"


def test_compare_opens_on_the_users_two_newest_runs(tmp_path, monkeypatch):
    import os

    runs = tmp_path / "runs"
    for n, (name, sample) in enumerate((("old", "gpt-2rank-cap1mb"), ("mid", "gpt-2rank-cap25mb"),
                                        ("new", "gpt-2rank-cap1mb"))):
        shutil.copytree(SAMPLES / sample, runs / name)
        for f in (runs / name).iterdir():
            os.utime(f, (1_700_000_000 + 100 * n,) * 2)
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    _page(at, "Compare runs")
    assert at.multiselect(key="compare_runs").value == ["run: mid", "run: new"]  # the older one the reference
    assert not at.exception and len(at.dataframe[0].value) == 2


def test_compare_opens_on_two_runs_of_one_kind(tmp_path):
    """A DDP run, another, then an FSDP2 run (newest): Compare sets like beside like, so it
    opens on the two DDP runs, not on the newest two (a dead end: "pick two of one kind").
    A lone run of a kind opens beside a sample of its kind; without kinds, the newest two."""
    from ddpscope.dashboard.timeline_page import compare_defaults

    traces = {}
    for n, name in enumerate(("old", "mid", "new")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text("{}")
        os.utime(tmp_path / name / "run.json", (1_700_000_000 + 100 * n,) * 2)
        traces[f"run: {name}"] = tmp_path / name
    traces["sample: gpt"] = SAMPLES / "gpt-2rank-cap1mb"
    kinds = {"run: old": "ddp", "run: mid": "ddp", "run: new": "sharded", "sample: gpt": "ddp"}
    assert compare_defaults(traces, kinds) == ["run: old", "run: mid"]
    assert compare_defaults(traces, {**kinds, "run: old": "sharded"}) == ["run: old", "run: new"]
    assert compare_defaults(traces, {**kinds, "run: mid": "sharded", "run: old": "zero"}) == \
        ["run: mid", "run: new"]
    alone = {k: v for k, v in traces.items() if k in ("run: new", "run: mid", "sample: gpt")}
    assert compare_defaults(alone, kinds) == ["run: mid", "sample: gpt"]  # no sharded sample
    assert compare_defaults(traces) == ["run: mid", "run: new"]


def test_compare_view_puts_runs_on_one_time_scale(app):
    """Two samples of one job at two caps: medians over every step with intervals, the
    layout change said before the numbers, each run's median step drawn on one scale."""
    _page(app, "Compare runs")
    table = app.dataframe[0].value
    assert len(table) == 2 and table["step_ms_vs_first"].iloc[0] == 0
    assert sorted(table["buckets"]) == [1, 20] and table["same_job"].all()
    assert (table["step_ms_lo"] <= table["step_ms"]).all() and (table["step_ms"] <= table["step_ms_hi"]).all()
    other = table.iloc[1]
    assert other["step_ms_vs_first_lo"] <= other["step_ms_vs_first"] <= other["step_ms_vs_first_hi"]
    assert other["within_noise"] == (other["step_ms_vs_first_lo"] <= 0 <= other["step_ms_vs_first_hi"])
    assert any("buckets differ" in i.value for i in app.info)
    titles = [json.dumps(_spec(app, n)["layout"]["title"]) for n in (0, 1)]
    assert all("its median step" in t for t in titles)
    ranges = [_spec(app, n)["layout"]["xaxis"]["range"] for n in (0, 1)]
    assert ranges[0] == ranges[1] and ranges[0][1] > 50
    app.multiselect(key="compare_runs").set_value(["sample: gpt-2rank-cap1mb", "sample: mlp-2rank-cap1mb"]).run()
    assert not app.exception
    assert any("is not the same job" in w.value for w in app.warning)


def test_upload_of_a_run_archive_opens_it(app):
    files = {f"gpt/{p.name}": p.read_bytes() for p in (SAMPLES / "gpt-2rank-cap25mb").iterdir()}
    app.sidebar.file_uploader(key="upload").upload("my-run.zip", _zip(files), "application/zip")
    app.run()
    assert not app.exception and not app.sidebar.error
    assert app.sidebar.selectbox(key="trace").value.startswith("upload: my-run-")
    assert _metric(app, "buckets") == "1"


def test_an_upload_of_summaries_only_opens_as_the_runs_folder_would(app, mlp_run):
    """The many-rank format (run.json and each rank's summary, no events) opens from the
    runs folder; uploaded, it opens too, rather than "has neither events nor a summary"."""
    files = {f"many/{p.name}": p.read_bytes() for p in mlp_run[0].iterdir()
             if p.name == "run.json" or p.name.endswith(".summary.jsonl")}
    app.sidebar.file_uploader(key="upload").upload("many.zip", _zip(files), "application/zip")
    app.run()
    assert not app.exception and not app.sidebar.error
    assert app.sidebar.selectbox(key="trace").value.startswith("upload: many-")
    assert app.dataframe[MEDIANS].value is not None and len(app.dataframe[MEDIANS].value) == 2  # both ranks


def test_uploads_of_one_file_never_remove_each_other(tmp_path, monkeypatch):
    """The same archive uploaded twice (two tabs, the same second), then a bad one of the
    same name: both good uploads stay, each in a folder of its own; the bad one leaves
    nothing and removes nothing it did not make."""
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    good = _zip({f"gpt/{p.name}": p.read_bytes() for p in (SAMPLES / "gpt-2rank-cap25mb").iterdir()})
    for data in (good, good, b"not an archive"):
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
        at.sidebar.file_uploader(key="upload").upload("my-run.zip", data, "application/zip")
        at.run()
        assert not at.exception
    assert at.sidebar.error  # the bad one: said in one line
    kept = sorted(p.name for p in (tmp_path / "runs" / "uploads").iterdir())
    assert len(kept) == 2 and all(k.startswith("my-run-") for k in kept)


def _sample_with(sample: str, name: str, old: bytes, new: bytes) -> dict[str, bytes]:
    """A sample's files, ``old`` replaced by ``new`` once in the file ``name``."""
    files = {p.name: p.read_bytes() for p in (SAMPLES / sample).iterdir()}
    assert old in files[name]
    files[name] = files[name].replace(old, new, 1)
    return files


@pytest.mark.parametrize("name, make, message", [
    ("notes.zip", lambda: b"just some text", "not a readable .zip or .tar(.gz) archive"),
    ("empty.zip", lambda: _zip({"readme.txt": b"hi"}), "holds no rank-<r>.json"),
    # a Chrome-trace object (format version 1, as the samples are, or a profiler's) cut short cannot be read
    ("trunc.zip", lambda: _zip({"rank-0.json": (SAMPLES / "mlp-2rank-cap1mb" / "rank-0.json").read_bytes()[:5000],
                                "rank-1.json": (SAMPLES / "mlp-2rank-cap1mb" / "rank-1.json").read_bytes()}),
     "is not valid JSON (truncated"),
    ("kineto.zip", lambda: _zip({"rank-0.json": json.dumps({"traceEvents": [], "schemaVersion": 1}).encode()}),
     "holds no timed events"),
    ("trunc.json.gz", lambda: gzip.compress(json.dumps(gpu_profile(0)).encode())[:-100],
     "truncated or corrupt gzip"),
    ("half.zip", lambda: _zip({"rank-0.json": (SAMPLES / "mlp-2rank-cap1mb" / "rank-0.json").read_bytes(),
                               "run.json": (SAMPLES / "mlp-2rank-cap1mb" / "run.json").read_bytes()}),
     "rank 1 of 2 are missing"),
    ("evil.zip", lambda: _zip({"../../escape/rank-0.json": b"{}"}), "unsafe path"),
    ("surrogate.zip", lambda: _zip(_sample_with("mlp-2rank-cap1mb", "rank-0.json", b'"layers.0.weight"', b'"layers.0.\\ud800"')),
     "rank-0.json is not valid JSON"),
    ("version.zip", lambda: _zip(_sample_with("mlp-2rank-cap1mb", "run.json", b'"version": 1', b'"version": "abc"')),
     "is not a version number"),
    ("digits.zip", lambda: _zip(_sample_with("gpt-2rank-cap1mb", "run.json", b'"world_size": 2',
                                             b'"world_size": 1' + b"0" * 5000)), "run.json is not valid JSON"),
])
def test_bad_uploads_give_one_line_and_the_page_keeps_working(app, tmp_path, name, make, message):
    app.sidebar.file_uploader(key="upload").upload(name, make())
    app.run()
    assert not app.exception
    err = app.sidebar.error[0].value
    assert message in err and "\n" not in err
    assert app.sidebar.selectbox(key="trace").value.startswith("sample:")  # still on what it showed
    assert not (tmp_path / "escape").exists() and not list((tmp_path / "runs").glob("uploads/*"))
    assert app.dataframe[MEDIANS].value is not None


def _wait_for_job(app, timeout=150):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        app.run()
        assert not app.exception
        if not app.get("progress"):
            return
    raise AssertionError("the run did not finish")


def _charts(app) -> list[dict]:
    return [json.loads(c.proto.spec) for c in app.get("plotly_chart")]


def _script_run(folder, argv, cwd="/tmp", nproc=2):
    """A copy of a sample that says it came from ``ddpscope run -- argv`` (no run needed)."""
    folder.mkdir(parents=True)
    for p in (SAMPLES / "gpt-2rank-cap1mb").iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    run = json.loads((folder / "run.json").read_text())
    run.pop("model", None)
    run.update(script={"argv": argv, "module": False, "path": str(ROOT / argv[0]), "cwd": cwd, "sha256": None},
               nproc_per_node=nproc, demo=None)
    (folder / "run.json").write_text(json.dumps(run))


@pytest.mark.ddp
def test_rerun_of_the_open_trace_shows_it_beside_its_source(app, tmp_path):
    """The open trace (the 1 MiB demo sample) rerun at 25 MiB from the Run page: progress
    where the user clicked, then both runs side by side with no picking."""
    assert app.sidebar.selectbox(key="trace").value == "sample: gpt-2rank-cap1mb"
    _page(app, "Run")
    app.select_slider(key="run_cap").set_value(25.0)
    app.slider(key="run_steps").set_value(4)
    app.button(key="run_button").click().run()
    assert app.get("progress"), "no progress shown"
    assert app.button(key="run_button").disabled  # a second click cannot start a second job
    _wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and f"run: {runs[0].name}" in app.sidebar.selectbox(key="trace").options
    table = [d.value for d in app.dataframe if "step_ms_vs_first" in d.value.columns][-1]
    assert list(table["run"]) == ["sample: gpt-2rank-cap1mb", f"run: {runs[0].name}"]
    assert list(table["bucket_cap_mb"]) == [1.0, 25.0] and table["buckets"].iloc[0] > table["buckets"].iloc[1]
    pair = [c for c in _charts(app) if "gpt-2rank-cap1mb: step" in json.dumps(c["layout"].get("title"))
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
    it wrote in run.json run from a shell (a cold torchrun): the same command, layout and
    conditions (threads, cores, nice), and step medians that differ by noise only: a user
    comparing a page rerun with a CLI run compares settings, not launchers."""
    _page(app, "Run")
    app.slider(key="run_steps").set_value(16)
    app.button(key="run_button").click().run()
    _wait_for_job(app)
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
    row = table.iloc[1]
    # noise only: the 95 % interval of the difference holds 0, or the difference is within a quarter
    # of the step (2 cores shared with the test's own process: a loose bound, a launcher's cost is not)
    assert row["within_noise"] or abs(row["step_ms_vs_first"]) <= 0.25 * table["step_ms"].iloc[0], table.to_string()


@pytest.mark.ddp
def test_a_rerun_with_a_size_per_bucket_checks_the_list_then_runs_it(app, tmp_path):
    _page(app, "Run")
    app.text_input(key="run_cap_list").set_value("0.5,x").run()
    app.button(key="run_button").click().run()
    assert not app.exception and not app.get("progress")
    assert any("--bucket-cap-mb-list must be sizes in MiB separated by commas" in e.value for e in app.error)
    assert not [p for p in (tmp_path / "runs").glob("*") if p.name != "uploads"]
    app.text_input(key="run_cap_list").set_value("0.5,2").run()
    assert app.button(key="run_button").label == "Rerun with bucket_cap_mb_list = 0.5,2"
    app.slider(key="run_steps").set_value(3)
    app.button(key="run_button").click().run()
    _wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["bucket_cap_bytes_list"] == [2**19, 2**21]
    assert run["bucket_cap_mb_list_requested"] == [0.5, 2.0] and "--bucket-cap-mb-list 0.5,2" in run["command"]


@pytest.mark.ddp
@pytest.mark.lab
@pytest.mark.skipif(why_not() is not None, reason=f"no emulated nodes here: {why_not()}")
def test_a_rerun_on_emulated_nodes_runs_across_the_shaped_links(app, tmp_path):
    _page(app, "Run")
    app.toggle(key="run_lab").set_value(True).run()
    app.select_slider(key="run_lab_link").set_value("200mbit")
    app.slider(key="run_nproc").set_value(1)
    app.slider(key="run_steps").set_value(3)
    app.button(key="run_button").click().run()
    _wait_for_job(app)
    assert not app.exception
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["world_size"] == 2
    assert run["emulation"]["nodes"] == 2 and run["emulation"]["link"] == "200mbit"
    assert not lab_leftovers()


@pytest.mark.ddp
def test_a_failed_rerun_shows_the_rank_and_reason_not_a_traceback(app, monkeypatch):
    monkeypatch.setenv("DDPSCOPE_TEST_FAIL", "1:1")
    _page(app, "Run")
    app.slider(key="run_steps").set_value(3)
    app.button(key="run_button").click().run()
    _wait_for_job(app)
    assert not app.exception
    assert any("failed: rank 1 failed: RuntimeError: injected failure" in e.value for e in app.error)
    assert "Traceback" in app.code[-1].value  # the rank's stderr tail, shown as text
    app.sidebar.selectbox(key="trace").set_value("sample: mlp-2rank-cap1mb").run()  # the page keeps working
    assert not app.exception


@pytest.mark.ddp
def test_a_new_command_is_checked_before_it_starts_then_runs(app, tmp_path):
    _page(app, "Run")
    app.text_input(key="new_cmd").set_value("missing.py --lr 3")
    app.text_input(key="new_cwd").set_value(str(tmp_path))
    app.button(key="new_button").click().run()
    assert not app.exception and not app.get("progress")
    assert any(e.value == f"script missing.py does not exist (in {tmp_path})" for e in app.error)
    assert not [p for p in (tmp_path / "runs").glob("*") if p.name != "uploads"]
    script = ROOT / "tests" / "workers" / "user_train.py"
    app.text_input(key="new_cmd").set_value(f"{script} --steps 4 --report {tmp_path / 'report'}")
    app.button(key="new_button").click().run()
    _wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and runs[0].name.split("-")[2] == "user_train"
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["script"]["cwd"] == str(tmp_path) and run["steps"] == 4
    assert (tmp_path / "report" / "check-rank1.json").exists()


def test_commands_are_off_when_the_page_is_reachable_from_other_machines(app, tmp_path, monkeypatch):
    _script_run(tmp_path / "runs" / "mine", ["tests/workers/user_train.py", "--steps", "3"])
    _page(app, "Run")
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
    _script_run(tmp_path / "runs" / "uploads" / "theirs", ["train.py"])
    _page(app, "Run")
    app.sidebar.selectbox(key="trace").set_value("upload: theirs").run()
    assert app.button(key="run_button").disabled
    assert any("uploaded" in i.value for i in app.info)


def _ring_specs(app) -> dict[str, dict]:
    """The Ring page's charts: animation (has frames), steps and what-if, by what they show."""
    specs = [json.loads(c.proto.spec) for c in app.get("plotly_chart")]
    out = {}
    for s in specs:
        if s.get("frames"):
            out["animation"] = s
        elif any(t.get("name") == "2M (limit)" for t in s["data"]):
            out["whatif"] = s
        elif "Time per ring step and rank" in json.dumps(s["layout"].get("title")):
            out["steps"] = s
    return out


def test_ring_page_animates_the_sample(app):
    assert _metric(app, "ranks") == "2"  # the timeline's run
    _page(app, "Ring all-reduce")
    assert app.selectbox(key="ring_trace").value == "sample: ring-4rank-4mb"
    assert "sample: ring-4rank-4mb" not in app.sidebar.selectbox(key="trace").options  # not a DDP run
    assert [str(m.value) for m in app.metric if m.label == "ranks"][:1] == ["4"]  # the ring's
    assert float(_metric(app, "ring, median (ms)")) > 0 and float(_metric(app, "dist.all_reduce, median (ms)")) > 0
    specs = _ring_specs(app)
    assert len(specs["animation"]["frames"]) == 2 * 3 + 1
    assert len(specs["steps"]["data"]) == 4
    summary = _table(app, "ring_ms")  # the ring summary (no other table has that column)
    assert list(summary["bytes"]) == [4096, 2**18, 2**22]


def test_ring_round_and_whatif_inputs(app):
    _page(app, "Ring all-reduce")
    rounds = app.select_slider(key="ring_round").options
    other = next(r for r in rounds if str(r) != str(app.select_slider(key="ring_round").value))
    app.select_slider(key="ring_round").set_value(int(other)).run()
    assert not app.exception
    assert _ring_specs(app)["animation"]["layout"]["meta"]["round"] == int(other)
    whatif = _ring_specs(app)["whatif"]
    assert any(t.get("name") == "measured (median)" for t in whatif["data"])  # at the traced size
    app.number_input(key="whatif_mb").set_value(64.0)
    app.number_input(key="whatif_alpha").set_value(0.0)
    app.number_input(key="whatif_bw").set_value(2.0).run()
    assert not app.exception
    whatif = _ring_specs(app)["whatif"]
    names = [t.get("name") for t in whatif["data"]]
    assert "measured (median)" not in names  # another size: nothing measured to show
    latency = whatif["data"][names.index("latency term 2(N-1)·a")]
    assert latency["x"][-1] == 64
    sent = whatif["data"][names.index("sent per rank (MiB)")]
    assert sent["y"][0] == 64.0 and 2 * 64 * 0.96 < sent["y"][-1] < 128.0  # approaching 2M


@pytest.mark.ddp
@pytest.mark.lab
@pytest.mark.skipif(why_not() is not None, reason=f"no emulated nodes here: {why_not()}")
def test_a_ring_run_from_the_page_on_emulated_nodes_is_fitted_against_the_link(app, tmp_path):
    _page(app, "Ring all-reduce")
    app.toggle(key="ring_lab").set_value(True).run()
    app.select_slider(key="ring_lab_link").set_value("200mbit")
    app.slider(key="ring_run_nproc").set_value(1)
    app.select_slider(key="ring_run_mb").set_value(0.5)
    app.slider(key="ring_run_repeat").set_value(2)
    app.button(key="ring_run_button").click().run()
    _wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and runs[0].name.endswith("-ring-1r-0.5mb-2x200mbit"), runs
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["world_size"] == 2 and run["emulation"]["link"] == "200mbit"
    app.selectbox(key="ring_trace").set_value(f"run: {runs[0].name}").run()
    assert not app.exception
    caption = next(c.value for c in app.caption if "alpha-beta fit" in c.value)
    assert "over 2 emulated nodes' 200mbit links (0.025 GB/s): B is" in caption
    fit = _table(app, "model_ms")
    assert list(fit["bytes"]) == [4096, 2**15, 2**19]
    assert not lab_leftovers()


def test_a_broken_ring_trace_shows_a_readable_error(app, tmp_path):
    bad = tmp_path / "runs" / "broken-ring"
    bad.mkdir(parents=True)
    for p in (SAMPLES / "ring-4rank-4mb").iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "rank-3.json").write_bytes(b'{"traceEvents": [')
    _page(app, "Ring all-reduce")
    app.selectbox(key="ring_trace").set_value("run: broken-ring").run()
    assert not app.exception
    assert any("rank-3.json is not valid JSON" in e.value and "\n" not in e.value for e in app.error)


def test_upload_of_a_ring_archive_opens_the_ring_page(app):
    files = {f"ring/{p.name}": p.read_bytes() for p in (SAMPLES / "ring-4rank-4mb").iterdir()}
    app.sidebar.file_uploader(key="upload").upload("my-ring.zip", _zip(files), "application/zip")
    _page(app, "Ring all-reduce")
    assert not app.exception and not app.sidebar.error
    assert app.selectbox(key="ring_trace").value.startswith("upload: my-ring-")
    assert len(_ring_specs(app)["animation"]["frames"]) == 7


def _chart(app, title_part: str) -> dict:
    for c in app.get("plotly_chart"):
        spec = json.loads(c.proto.spec)
        if title_part in json.dumps(spec["layout"].get("title")) or title_part in json.dumps(spec["layout"].get("yaxis")):
            return spec
    raise AssertionError(f"no chart with {title_part!r}")


def _table(app, column: str):
    return next(d.value for d in app.dataframe if column in d.value.columns)


def test_memory_page_shows_the_zero_sample_beside_the_model(app):
    _page(app, "Memory (ZeRO)")
    assert app.selectbox(key="zero_trace").value == "sample: zero-gpt-2rank"
    run = _chart(app, "measured vs predicted per ZeRO stage (MiB)")  # binary units by default
    bars = {t["name"]: t for t in run["data"]}
    assert {"parameters", "gradients", "optimizer state"} <= set(bars)
    assert bars["parameters"]["x"][1][:4] == ["measured"] * 4 and bars["parameters"]["x"][1][4:] == ["predicted"] * 4
    table = next(d.value for d in app.dataframe if {"measured/predicted", "name"} <= set(d.value.columns))
    assert len(table) == 4 and ((table["measured/predicted"] - 1).abs() < 0.05).all()
    comm = _table(app, "collective")
    assert set(comm["collective"]) == {"all_reduce", "broadcast", "all_gather"}
    # the open run (a DDP sample: stage 0) first, beside the ZeRO model; the sample predates the
    # optimizer's name in run.json, so K is read off the measurement, and the page says so
    ddp = _table(app, "measured/predicted")
    assert list(ddp["row"]) == ["measured (rank 0)", "measured (rank 1)", "stage 0", "stage 1", "stage 2", "stage 3"]
    assert any("K unknown to ddpscope, read off the measurement" in m.value for m in app.markdown)
    # one unit family for the whole page: the open run's figure and table follow the choice too
    assert _chart(app, "MiB per rank")["layout"]["legend"]["yref"] == "container"  # below the axis title
    mib = ddp["model_state_MiB"]
    app.radio(key="zero_unit").set_value("decimal").run()
    assert not app.exception
    assert _table(app, "model_state_MB")["model_state_MB"].tolist() == pytest.approx((mib * 2**20 / 1e6).tolist(),
                                                                                     abs=1e-3)
    _chart(app, "MB per rank"), _chart(app, "measured vs predicted per ZeRO stage (MB)")
    assert not any(c.endswith(("MiB", "GiB")) for d in app.dataframe for c in d.value.columns)


def test_memory_projection_reproduces_figure_1_and_reacts_to_widgets(app):
    _page(app, "Memory (ZeRO)")
    # the paper's 7.5B parameters (the default), N = 64, mixed precision, K = 12, in its GB
    app.radio(key="zero_unit").set_value("decimal").run()
    table = _table(app, "per device (GB)")
    assert table["per device (GB)"].round(1).tolist() == [120.0, 31.4, 16.6, 1.9]
    assert _chart(app, "per device (GB)")["layout"]["yaxis"]["title"]["text"] == "per device (GB)"
    app.radio(key="zero_unit").set_value("binary").run()
    assert _table(app, "per device (GiB)")["per device (GiB)"].iloc[0] == pytest.approx(120e9 / 2**30, abs=1e-3)
    assert app.number_input(key="proj_device").label == "device memory (GiB)"
    app.radio(key="zero_unit").set_value("decimal").run()
    app.select_slider(key="proj_n").set_value(8).run()
    assert _table(app, "per device (GB)")["per device (GB)"].round(3).tolist()[3] == 15.0
    app.selectbox(key="proj_preset").set_value("GPT-3 (175B)").run()
    assert app.select_slider(key="proj_params_b").value == 175.0
    app.select_slider(key="proj_params_b").set_value(1000.0).run()
    assert _table(app, "per device (GB)")["per device (GB)"].iloc[0] == pytest.approx((2 + 2 + 12) * 1000)
    app.radio(key="proj_precision").set_value("fp32").run()
    assert app.slider(key="proj_k").value == 8
    app.checkbox(key="proj_act").check().run()
    assert not app.exception
    fits = _table(app, "largest model that fits (B params)")["largest model that fits (B params)"]
    assert fits.is_monotonic_increasing


def test_a_broken_zero_run_shows_a_readable_error(app, tmp_path):
    bad = tmp_path / "runs" / "broken-zero"
    bad.mkdir(parents=True)
    (bad / "run.json").write_bytes((SAMPLES / "zero-gpt-2rank" / "run.json").read_bytes())
    (bad / "rank-0.json").write_text(json.dumps({"traceEvents": [], "otherData": {"ddpscope": {
        "format": "ddpscope-trace", "version": 1, "rank": 0, "world_size": 2}}}))
    (bad / "rank-1.json").write_bytes((SAMPLES / "zero-gpt-2rank" / "rank-1.json").read_bytes())
    _page(app, "Memory (ZeRO)")
    app.selectbox(key="zero_trace").set_value("run: broken-zero").run()
    assert not app.exception
    assert any("rank-0.json holds no ZeRO stage measurements" in e.value for e in app.error)


@pytest.mark.ddp
def test_ring_and_zero_runs_start_from_their_pages(app, tmp_path):
    _page(app, "Ring all-reduce")
    app.slider(key="ring_run_nproc").set_value(2)
    app.select_slider(key="ring_run_mb").set_value(0.5)
    app.slider(key="ring_run_repeat").set_value(2)
    app.button(key="ring_run_button").click().run()
    assert app.get("progress") and app.button(key="ring_run_button").disabled  # one job at a time
    _page(app, "Memory (ZeRO)")
    # A 2-rank ring run can end within the page switch (it did in CI): the button follows the job.
    assert app.button(key="zero_run_button").disabled == bool(app.get("progress"))
    _wait_for_job(app)
    _page(app, "Ring all-reduce")
    assert any("on the Ring all-reduce tab" in s.value for s in app.sidebar.success)
    ring_label = next(o for o in app.selectbox(key="ring_trace").options if o.startswith("run: "))
    app.selectbox(key="ring_trace").set_value(ring_label).run()
    assert not app.exception and len(_ring_specs(app)["animation"]["frames"]) == 3  # 2 ranks: 2 steps + start

    _page(app, "Memory (ZeRO)")
    app.selectbox(key="zero_run_model").set_value("mlp")
    app.button(key="zero_run_button").click().run()
    assert app.get("progress") and app.button(key="zero_run_button").disabled
    _page(app, "Ring all-reduce")  # four stages one after another: still running here
    assert app.get("progress") and app.button(key="ring_run_button").disabled
    _page(app, "Memory (ZeRO)")
    _wait_for_job(app)
    assert any("on the Memory (ZeRO) tab" in s.value for s in app.sidebar.success)
    zero_label = next(o for o in app.selectbox(key="zero_trace").options if o.startswith("run: "))
    app.selectbox(key="zero_trace").set_value(zero_label).run()
    table = next(d.value for d in app.dataframe if {"measured/predicted", "name"} <= set(d.value.columns))
    assert len(table) == 4 and ((table["measured/predicted"] - 1).abs() < 0.05).all()


def test_timeline_offers_the_merged_perfetto_trace(app):
    buttons = app.get("download_button")
    assert len(buttons) == 1 and "Perfetto" in buttons[0].proto.label


def test_a_ring_run_with_no_complete_round_says_so(app, tmp_path):
    bad = tmp_path / "runs" / "no-rounds"
    bad.mkdir(parents=True)
    for p in (SAMPLES / "ring-4rank-4mb").iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    doc = json.loads((bad / "rank-3.json").read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "ring_step"]
    (bad / "rank-3.json").write_text(json.dumps(doc))
    _page(app, "Ring all-reduce")
    app.selectbox(key="ring_trace").set_value("run: no-rounds").run()
    assert not app.exception
    assert any("no ring round finished on every rank" in e.value for e in app.error)


def test_a_ring_round_whose_sends_do_not_add_up_says_so_and_the_page_goes_on(app, tmp_path):
    """Rank 1 receives its own chunk at every round's first step (an edited trace): the
    replay would count its data twice; the page says so and draws the rest."""
    bad = tmp_path / "runs" / "twice"
    bad.mkdir(parents=True)
    for p in (SAMPLES / "ring-4rank-4mb").iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    doc = json.loads((bad / "rank-1.json").read_text())
    for e in doc["traceEvents"]:
        if e.get("cat") == "ring_step" and e["args"]["step"] == 0:
            e["args"].update(recv_from=1, recv_chunk=e["args"]["send_chunk"])
    (bad / "rank-1.json").write_text(json.dumps(doc))
    _page(app, "Ring all-reduce")
    app.selectbox(key="ring_trace").set_value("run: twice").run()
    assert not app.exception
    assert any("cannot be replayed" in e.value and "twice" in e.value for e in app.error)
    assert any(d.value is not None and len(d.value) for d in app.dataframe)  # the summary table is still drawn


def _predict_chart(app, title_part="Predicted step time against bucket_cap_mb") -> dict:
    return _chart(app, title_part)


def _vs_table(app):
    """The What-if page's predicted-beside-measured table (dataframes carry no key)."""
    return next(d.value for d in app.dataframe if "run" in d.value.columns
                and any(str(r).startswith("predicted at") for r in d.value["run"]))


def _proj_table(app):
    """The projection's table: the last cap sweep on the page (the first is the prediction's)."""
    return [d.value for d in app.dataframe if "traced" in d.value.columns][-1]


def test_whatif_page_draws_the_predicted_curve_with_the_measured_runs_on_it(app):
    """The open sample (GPT, 1 MiB) predicted at every cap; the other GPT sample (25 MiB,
    same job) is a measured point; the best cap is starred; a predicted timeline shows
    beside the measured run at the chosen cap."""
    _page(app, "What-if")
    spec = _predict_chart(app)
    traces = {t["name"]: t for t in spec["data"]}
    assert {"step (predicted)", "exposed communication (predicted)", "step (measured runs)",
            "best cap (predicted)", "traced cap (replayed)"} <= set(traces)
    assert spec["layout"]["xaxis"]["type"] == "log"
    assert spec["layout"]["xaxis"]["ticktext"][:4] == ["0.25", "0.5", "1", "2"]  # the caps, not 2 5 1 2 5
    assert sorted(traces["step (measured runs)"]["x"]) == [1.0, 25.0]
    assert traces["traced cap (replayed)"]["x"] == [1.0]
    app.select_slider(key="predict_cap").set_value(25.0).run()
    assert not app.exception
    vs = _vs_table(app)
    assert list(vs["run"]) == ["predicted at 25 MiB", "sample: gpt-2rank-cap25mb (measured)"]
    assert list(vs["buckets"]) == [1, 1]  # as DDP built it: an explicit 25 MiB caps the first bucket too
    titles = [json.dumps(c["layout"].get("title")) for c in _charts(app)]
    assert any("predicted at 25 MiB" in t for t in titles) and any("(measured)" in t for t in titles)


@pytest.mark.breadth
def test_whatif_projection_reacts_to_world_size_and_link(app):
    _page(app, "What-if")
    assert "64 ranks" in json.dumps(_predict_chart(app, "Projection:")["layout"]["title"])
    app.selectbox(key="predict_proj_link").set_value("NVLink (H100 SXM, one node)").run()
    fast = _proj_table(app)
    assert app.number_input(key="predict_proj_bw").value == 360.0
    app.selectbox(key="predict_proj_link").set_value("Ethernet 25 Gb/s (TCP)").run()
    app.number_input(key="predict_proj_n").set_value(1024).run()
    assert not app.exception
    slow = _proj_table(app)
    assert "1024 ranks" in json.dumps(_predict_chart(app, "Projection:")["layout"]["title"])
    assert (slow["exposed_ms"].to_numpy() > fast["exposed_ms"].to_numpy()).all()
    app.number_input(key="predict_proj_bw").set_value(1e4).run()  # edited by hand
    app.number_input(key="predict_proj_lat").set_value(0.0).run()
    assert (_proj_table(app)["exposed_ms"] < slow["exposed_ms"]).all()


def test_whatif_refuses_a_trace_it_cannot_predict_in_one_line(app, tmp_path):
    bad = tmp_path / "runs" / "no-sizes"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", bad)
    run = json.loads((bad / "run.json").read_text())
    run.pop("param_bytes")
    (bad / "run.json").write_text(json.dumps(run))
    _page(app, "What-if")  # lists the new folder
    app.sidebar.selectbox(key="trace").set_value("run: no-sizes").run()
    assert not app.exception
    assert any("No prediction for this trace" in i.value and "param" in i.value for i in app.info)


@pytest.mark.ddp
def test_run_at_the_predicted_cap_puts_the_real_run_on_the_curve(app, tmp_path):
    _page(app, "What-if")
    app.select_slider(key="predict_cap").set_value(4.0).run()
    app.button(key="predict_run").click().run()
    assert app.get("progress")
    _wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and json.loads((runs[0] / "run.json").read_text())["bucket_cap_mb"] == 4.0
    app.select_slider(key="predict_cap").set_value(4.0).run()
    measured = {t["name"]: t for t in _predict_chart(app)["data"]}["step (measured runs)"]
    assert 4.0 in measured["x"] and f"run: {runs[0].name}" in measured["text"]
    vs = _vs_table(app)
    assert list(vs["run"]) == ["predicted at 4 MiB", f"run: {runs[0].name} (measured)"]


def test_whatif_and_run_offer_a_torch_compiled_model_no_cap_its_ddp_optimizer_refuses(app, tmp_path):
    """A run whose run.json says torch.compile's DDPOptimizer splits its graphs (the fact
    set here on a sample; tests/tracer/capture/autotrace/test_torch_compile.py records it
    from a real compiled run): no cap under 1 MiB on the curve, and the page says why."""
    compiled = tmp_path / "runs" / "compiled"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", compiled)
    run = json.loads((compiled / "run.json").read_text())
    run["torch_compile"] = {"graphs": 2, "inside": True, "optimize_ddp": "ddp_optimizer"}
    (compiled / "run.json").write_text(json.dumps(run))
    _page(app, "What-if")
    app.sidebar.selectbox(key="trace").set_value("run: compiled").run()
    assert not app.exception
    xs = {x for t in _predict_chart(app)["data"] if t["name"] == "step (predicted)" for x in t["x"]}
    assert min(xs) == 1.0 and 0.25 not in xs and 0.5 not in xs
    assert any("DDPOptimizer refuses a bucket cap under 1 MiB" in c.value for c in app.caption)
    _page(app, "Run")  # its rerun offers none either
    assert not app.exception
    assert [float(o) for o in app.select_slider(key="run_cap").options][:2] == [1.0, 2.0]
    assert any("torch.compile'd" in c.value and "start at 1 MiB" in c.value for c in app.caption)
    app.toggle(key="run_cap_default").set_value(False).run()
    app.text_input(key="run_cap_list").set_value("0.25,0.5").run()
    app.button(key="run_button").click().run()  # refused on the page, nothing started
    assert not app.exception
    assert any("largest entry is under 1 MiB" in e.value for e in app.error)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["compiled"]


def test_whatif_page_gives_one_number_per_setting_and_shades_the_noise(app):
    """The curve's table and the advisor's candidates come from one replay: each uniform
    cap's step is the same in both; the caps whose steps cannot be told apart from the
    fastest one are shaded on the curve and named under it."""
    _page(app, "What-if")
    table = next(d.value for d in app.dataframe if {"bucket_cap_mb", "within_noise"} <= set(d.value.columns))
    cands = next(d.value for d in app.dataframe if {"kind", "label", "step_ms"} <= set(d.value.columns))
    by_cap = {float(r.bucket_cap_mb): float(r.step_ms) for r in table.itertuples() if not r.traced}
    uniform = cands[cands["kind"] == "uniform"]
    assert len(uniform) >= 10
    for r in uniform.itertuples():
        assert r.step_ms == pytest.approx(by_cap[float(r.label.split("=")[1])], abs=0.006)  # both rounded to 0.01
    spec = _predict_chart(app)
    bands = [s for s in spec["layout"].get("shapes", []) if s.get("y1", 0) > s.get("y0", 0)]
    assert len(bands) == 1 and bands[0]["y0"] == pytest.approx(table["step_ms"].min(), abs=0.01)
    alike = table[table["within_noise"]]
    assert 1 < len(alike) < len(table)  # some caps are alike, not all
    assert set(table["bucket_cap_mb_list"]) == {"–"}  # an empty cell, not "None"
    assert {d.proto.placeholder for d in app.dataframe} == {"–"}  # a missing number too, on every table
    config = json.loads(next(d for d in app.dataframe if "within_noise" in d.value.columns).proto.columns)
    assert config["step_ms"]["label"] == "step (ms)" and config.get("bucket_cap_mb", {}).get("label") in (None, "bucket_cap_mb")
    assert any("cannot be told apart from it" in c.value for c in app.caption)


def test_whatif_advisor_says_keep_or_change(app):
    """The MLP sample: no change worth it; the 25 MiB GPT sample (one bucket after
    backward, with its calibration): a change, with its interval, and its Apply button."""
    app.sidebar.selectbox(key="trace").set_value("sample: mlp-2rank-cap1mb").run()
    _page(app, "What-if")
    assert any(i.value.startswith("Advisor: keep bucket_cap_mb=1") and "noise" in i.value for i in app.info)
    searched = next(e.label for e in app.expander if e.label.startswith("What the advisor searched"))
    for part in searched.split(": ", 1)[1].replace(" and ", ", ").split(", "):  # "1 per-bucket layout" (this sample's)
        count, word = part.split(" ", 1)
        assert word.endswith("s") == (int(count) != 1), searched
    app.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap25mb").run()
    assert not app.exception
    said = next(s.value for s in app.success if s.value.startswith("Advisor:"))
    assert "95 % interval" in said and "faster" in said
    assert app.button(key="advice_apply").label.startswith("Apply: run it again with bucket_cap_mb")
    assert len(next(d.value for d in app.dataframe if {"kind", "label", "step_ms"} <= set(d.value.columns))) > 40


@pytest.mark.ddp
def test_apply_on_the_page_reruns_and_shows_a_against_b(app, tmp_path):
    """Apply on the 25 MiB sample: a real rerun with the recommendation whose run.json
    says where it came from; opening it shows A against B: steps, the diff timeline, the
    bucket table."""
    _page(app, "What-if")
    app.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap25mb").run()
    app.button(key="advice_apply").click().run()
    _wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["advice"]["from"] == str((SAMPLES / "gpt-2rank-cap25mb").resolve()) and run["status"] == "complete"
    app.sidebar.selectbox(key="trace").set_value(f"run: {runs[0].name}").run()
    assert not app.exception
    steps = next(d.value for d in app.dataframe if "B predicted" in d.value.columns)
    assert list(steps["median"]) == ["step_ms", "exposed_ms", "comm_ms", "backward_ms"]
    assert {"A measured", "B predicted", "B measured", "error %"} <= set(steps.columns)
    assert any("exposed_ms B" in d.value.columns for d in app.dataframe)
    names = {t.get("name") for t in _chart(app, "A against B")["data"]}
    assert {"A (measured): all-reduce", "B (measured): all-reduce"} <= names


def test_upload_of_a_profiler_trace_opens_its_kernel_timeline(app):
    app.sidebar.file_uploader(key="upload").upload("worker0.pt.trace.json.gz",
                                                   gzip.compress(json.dumps(gpu_profile(0, world=8)).encode()))
    app.run()
    assert not app.exception and not app.sidebar.error
    assert app.sidebar.selectbox(key="trace").value.startswith("upload: worker0")
    assert _metric(app, "source") == "torch.profiler" and _metric(app, "ranks") == "1 of 8"
    lanes = _spec(app)["layout"]["yaxis"]["ticktext"]
    assert lanes == ["rank 0 · compute", "rank 0 · allreduce", "rank 0 · exposed comm"]
    hta = next(d.value for d in app.dataframe if "comp_comm_overlap_pct" in d.value.columns)
    assert hta["comp_comm_overlap_pct"].round(2).tolist() == [33.33]
    _page(app, "What-if")
    assert any("No prediction for a profiler trace" in i.value for i in app.info)  # What-if says why


@pytest.mark.skipif(not KINETO.is_dir(), reason="../shared/data/kineto is absent")
def test_shared_gpu_traces_open_with_per_stream_lanes(app, tmp_path):
    (tmp_path / "runs").mkdir(exist_ok=True)
    (tmp_path / "runs" / "cluster").symlink_to(KINETO / "hta-sampled-2rank")  # read in place, never copied
    app.run()
    app.sidebar.selectbox(key="trace").set_value("run: cluster").run()
    assert not app.exception and not app.error
    assert _metric(app, "ranks") == "2 of 128"
    assert any("2 of the job's 128 ranks" in i.value for i in app.info)
    app.toggle(key="per_stream").set_value(True).run()
    lanes = _spec(app)["layout"]["yaxis"]["ticktext"]
    assert "rank 1 · stream 7" in lanes and "rank 1 · sendrecv" in lanes


@pytest.mark.ddp
def test_a_profiled_run_shows_the_profiler_beside_the_tracer(app, tmp_path, profiled_run):
    shutil.copytree(profiled_run, tmp_path / "runs" / "profiled")
    app.run()
    app.sidebar.selectbox(key="trace").set_value("run: profiled").run()
    app.select_slider(key="steps").set_value((2, 3)).run()
    assert not app.exception and not app.error
    titles = [json.dumps(_spec(app, n)["layout"].get("title")) for n in range(len(app.get("plotly_chart")))]
    assert any("torch.profiler" in t for t in titles)
    table = next(d.value for d in app.dataframe if "end_before_done_ms" in d.value.columns)
    assert sorted(table["step"].unique()) == [2, 3] and (table["tracer_bytes"] == table["profile_bytes"]).all()


def test_a_run_folder_that_cannot_be_read_never_stops_the_page(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    bad = runs / "deep"
    bad.mkdir(parents=True)
    (bad / "run.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's recursion limit
    (bad / "rank-0.json").write_text("{}")
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", runs / "good")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
    at.run()
    assert not at.exception
    options = at.sidebar.selectbox(key="trace").options
    assert "run: good" in options and "run: deep" in options  # listed, as what it is
    at.sidebar.selectbox(key="trace").set_value("run: deep").run()
    assert not at.exception and any("nested too deeply" in e.value for e in at.error)
    at.sidebar.selectbox(key="trace").set_value("run: good").run()
    assert not at.exception and at.dataframe[MEDIANS].value is not None


def test_a_run_whose_trace_was_not_finished_says_incomplete_not_complete(tmp_path, monkeypatch):
    """A rank file still "running" (its last write never came: a full disk, a stopped
    run) under a run.json that says complete: the page shows it incomplete, with where
    it stopped, and still draws what was written."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", runs / "cut")
    rank1 = runs / "cut" / "rank-1.json"
    data = json.loads(rank1.read_text())
    data["otherData"]["ddpscope"].update(status="running", steps=4)
    rank1.write_text(json.dumps(data))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
    at.run()
    at.sidebar.selectbox(key="trace").set_value("run: cut").run()
    assert not at.exception and not at.error
    assert _metric(at, "status") == "incomplete"
    assert any("rank 1 after step 4" in w.value for w in at.warning)
    assert at.get("plotly_chart") and at.dataframe[MEDIANS].value is not None


@pytest.mark.ddp
@pytest.mark.breadth
def test_a_click_from_a_page_drawn_before_a_run_began_is_answered_not_dropped(app, tmp_path):
    """Two tabs: the second was drawn while nothing ran (its Run button enabled). Its
    click while the first tab's run goes on says so, and starts nothing."""
    slow = tmp_path / "slow.py"  # a job that surely outlasts the second click (no DDP: nothing traced)
    slow.write_text("import time\ntime.sleep(20)\n")
    other = _page(AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run(), "Run")
    assert not other.button(key="run_button").disabled
    _page(app, "Run")
    app.text_input(key="new_cmd").input(str(slow))
    app.button(key="new_button").click().run()
    assert app.get("progress") and app.button(key="run_button").disabled
    other.button(key="run_button").click().run()
    assert any("A run is already going" in i.value for i in other.info)
    _wait_for_job(app)
    assert len([p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]) == 1


def test_a_bad_run_left_in_uploads_breaks_no_session(tmp_path, monkeypatch):
    """A run folder that does not load (here: a parameter name that is a lone surrogate,
    and a run.json with version "abc", put straight into uploads/ as an older ddpscope
    could have) never takes a session down: every page draws, the folders are listed,
    and each says what is wrong when opened."""
    for name, (file, old, new) in {"surrogate": ("rank-0.json", b'"layers.0.weight"', b'"layers.0.\\ud800"'),
                                   "abc": ("run.json", b'"version": 1', b'"version": "abc"')}.items():
        folder = tmp_path / "runs" / "uploads" / name
        folder.mkdir(parents=True)
        for f, data in _sample_with("mlp-2rank-cap1mb", file, old, new).items():
            (folder / f).write_bytes(data)
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    st_config.set_option("server.address", "127.0.0.1")
    for _ in range(2):  # a fresh session, twice
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
        assert not at.exception and not at.error, [e.value for e in at.error]
        options = at.sidebar.selectbox(key="trace").options
        assert "upload: surrogate" in options and "upload: abc" in options
    for label, message in (("upload: surrogate", "rank-0.json is not valid JSON"), ("upload: abc", "version number")):
        at.sidebar.selectbox(key="trace").set_value(label).run()
        assert not at.exception
        errors = [e.value for e in at.error]
        assert any(message in e for e in errors) and all("\n" not in e for e in errors), errors


def test_the_page_opens_on_the_users_newest_run(tmp_path, monkeypatch):
    """`ddpscope dashboard runs` after `ddpscope run --out runs/...`: the user's newest run
    is shown first, not a sample."""
    for name in ("older", "newer"):
        shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", tmp_path / "runs" / name)
        time.sleep(0.05)
        (tmp_path / "runs" / name / "run.json").touch()
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    st_config.set_option("server.address", "127.0.0.1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and at.sidebar.selectbox(key="trace").value == "run: newer"


def test_a_run_folder_opens_that_run_and_its_own_folders_are_never_runs(tmp_path, monkeypatch):
    """``ddpscope dashboard runs/mine`` (a run folder): the page lists the runs beside it,
    opens that one, and never lists a run's ``live/``, ``logs/`` or ``models/`` as runs of
    their own (a runs folder that is itself a run lists its parts otherwise)."""
    import shutil

    from ddpscope.cli.dashboard import is_run_folder

    runs = tmp_path / "runs"
    for name in ("older", "mine", "newer"):
        shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", runs / name)
    (runs / "mine" / "live").mkdir(exist_ok=True)
    shutil.copy(runs / "mine" / "rank-0.json", runs / "mine" / "live" / "rank-0.json")
    assert is_run_folder(runs / "mine") and not is_run_folder(runs) and not is_run_folder(tmp_path / "nothing")
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    monkeypatch.setenv("DDPSCOPE_OPEN_RUN", "mine")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and at.sidebar.selectbox(key="trace").value == "run: mine"
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs / "mine"))  # a run folder given as the runs folder
    monkeypatch.delenv("DDPSCOPE_OPEN_RUN")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception
    assert not [o for o in at.sidebar.selectbox(key="trace").options if o.startswith("run: ")]  # no "run: live"


def test_a_dangling_link_in_a_run_folder_does_not_stop_the_page(tmp_path, monkeypatch):
    """A run folder holding a link to nothing (a log moved away): every page opens the
    run, as ``summary`` does."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", runs / "mine")
    (runs / "mine" / "notes.txt").symlink_to(tmp_path / "gone.txt")
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and not at.error and at.sidebar.selectbox(key="trace").value == "run: mine"
    assert _spec(at)["data"]


def test_a_run_with_no_finished_step_says_so_in_one_line(tmp_path, monkeypatch):
    """A run whose ranks recorded no step (it died before its first step closed): the
    Timeline says so in the project's words, not "cannot convert float NaN to integer"."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", runs / "early")
    for r in (0, 1):
        path = runs / "early" / f"rank-{r}.json"
        doc = json.loads(path.read_text())
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") == "M"]
        path.write_text(json.dumps(doc))
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception
    said = [e.value for e in at.error]
    assert said and all("NaN" not in m for m in said) and any("holds no finished step" in m for m in said)


def test_a_profile_with_no_profiler_step_says_how_to_take_one(tmp_path, monkeypatch):
    """A profiler trace recorded without a schedule (no ProfilerStep): the Timeline says
    what is missing and how to record it, instead of an IndexError."""
    from tests.viz.sources.test_kineto import gpu_profile, write

    doc = gpu_profile(0, world=1, comm=False)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    write(tmp_path / "runs" / "prof", "rank-0.json", doc)
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception
    said = [w.value for w in at.warning] + [e.value for e in at.error]
    assert any("ProfilerStep" in m for m in said) and not any("IndexError" in m for m in said), said


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_missing_or_empty_runs_folder_says_so_and_shows_the_samples(tmp_path, monkeypatch, state):
    runs = tmp_path / "runs"
    if state == "empty":
        runs.mkdir()
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and at.sidebar.selectbox(key="trace").value.startswith("sample: ")
    said = [i.value for i in at.sidebar.info if str(runs) in i.value]
    assert len(said) == 1 and ("does not exist" if state == "missing" else "holds no run yet") in said[0]
    assert "showing ddpscope's samples" in said[0]


@pytest.mark.ddp
def test_a_sharded_run_opens_on_its_timeline_memory_and_rerun_pages(tmp_path, monkeypatch):
    """A user's FSDP2 run (traced and profiled here): the Timeline draws units against all-gather and
    reduce-scatter lanes and sets each collective beside the profiler's, the Memory page opens on it,
    the Run page predicts a rerun."""
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS

    at, out = _open_traced(tmp_path, monkeypatch, str(WORKERS / "fsdp2_train.py"), "--steps", "4", name="fsdp2",
                           ddpscope=("--profile", "--profile-steps", "2"))
    assert at.sidebar.selectbox(key="trace").value == "run: fsdp2"  # the user's newest run
    assert _metric(at, "ZeRO stage") == "3" and _metric(at, "FSDP units") == "5"
    spec = _spec(at)
    ticks = spec["layout"]["yaxis"]["ticktext"]
    assert ticks[:3] == ["rank 0 · compute", "rank 0 · all-gather", "rank 0 · reduce-scatter"]
    assert {"layers.0", "waiting for an all-gather"} <= {t["name"] for t in spec["data"]}
    units = next(d.value for d in at.dataframe if "all_gather_ms" in d.value.columns)
    assert list(units["unit"]) == ["(root)", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert any("gloo has no reduce-scatter" in m.value for m in at.markdown)
    # profiled: each collective beside the profiler's, in the expander (2 steps x 2 ranks x 15)
    agreement = next(d.value for d in at.dataframe if "start_after_ms" in d.value.columns)
    assert len(agreement) == 2 * 2 * 15 and agreement["profile_bytes"].notna().all()
    _page(at, "What-if")  # not a dead end: where its own settings are predicted
    assert not at.exception and any("sharded run (FSDP2)" in i.value and "Run page" in i.value for i in at.info)
    _page(at, "Memory (ZeRO)")
    titles = [json.dumps(c["layout"].get("title")) for c in _charts(at)]
    assert any("memory over one step (measured)" in t for t in titles)
    assert any("beside ZeRO stages 0-3" in t for t in titles)
    _page(at, "Run")
    assert _metric(at, "predicted peak (rank 0)").endswith("MiB")
    deltas = {m.label: m.delta for m in at.metric if m.label.startswith("predicted")}
    assert deltas == {"predicted peak (rank 0)": "as this run", "predicted step (rank 0)": "as this run"}  # not "+0.0"
    at.selectbox(key="run_reshard").set_value("false (ZeRO-2)").run()
    assert not at.exception
    peak = next(m for m in at.metric if m.label == "predicted peak (rank 0)")
    assert peak.delta.startswith("+") and peak.delta.endswith(" MiB")  # units kept gathered: a larger peak
    assert at.button(key="run_button").label == "Rerun with reshard_after_forward = false"
    _page(at, "Compare runs")  # like with like: the DDP sample is not set beside the FSDP2 run
    at.multiselect(key="compare_runs").set_value(["run: fsdp2", "sample: gpt-2rank-cap1mb"]).run()
    assert not at.exception
    assert any(w.value.startswith("sample: gpt-2rank-cap1mb not compared with run: fsdp2") for w in at.warning)
    assert not any("buckets differ" in i.value for i in at.info)
    for r in (0, 1):  # the same run without its memory samples: the Run page says what it cannot predict
        path = out / f"rank-{r}.json"
        text = path.read_text()
        doc = json.loads(text if text.rstrip().endswith("]") else text + "]")
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        kept = [e for e in events if e.get("cat") != "memory_sample"]
        path.write_text(json.dumps({"traceEvents": kept} if isinstance(doc, dict) else kept))
        (out / f"rank-{r}.summary.jsonl").unlink(missing_ok=True)
    at = _page(AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run(), "Run")
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("measured no step's memory" in i.value for i in at.info)
    for r in (0, 1):  # ... and without any step (killed in its first): every page opens, none raises
        path = out / f"rank-{r}.json"
        doc = json.loads(path.read_text())
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        kept = [e for e in events if e.get("ph") == "M"]
        path.write_text(json.dumps({"traceEvents": kept} if isinstance(doc, dict) else kept))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    said = [e.value for e in at.error] + [i.value for i in at.info] + [w.value for w in at.warning]
    assert not at.exception, said
    for page in ("Run", "What-if", "Memory (ZeRO)", "Compare runs"):
        _page(at, page)
        assert not at.exception, (page, said)
    assert any("no finished step" in text for text in said), said  # the Timeline says why it draws nothing


@pytest.mark.deepspeed
def test_a_deepspeed_run_opens_on_its_timeline_memory_and_rerun_pages(tmp_path, monkeypatch):
    """A user's DeepSpeed ZeRO-2 run (traced here): the Timeline names DeepSpeed and draws
    its bucket all-reduces and the gather after the step, with the bucket table; the
    Memory page sets it beside the stages and DeepSpeed's estimators; the Run page offers
    another stage with its predicted model states."""
    pytest.importorskip("deepspeed")
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS

    at, out = _open_traced(tmp_path, monkeypatch, str(WORKERS / "deepspeed_train.py"), "--stage", "2", "--steps", "3",
                           "--reduce-bucket-size", "20000", name="ds2", env={"DS_ACCELERATOR": "cpu"})
    assert at.sidebar.selectbox(key="trace").value == "run: ds2"
    assert _metric(at, "ZeRO stage") == "2" and _metric(at, "DeepSpeed units") == "4"
    spec = _spec(at)
    assert spec["layout"]["title"]["text"].startswith("DeepSpeed, ZeRO stage 2")
    buckets = next(d.value for d in at.dataframe if "first_param" in d.value.columns)
    assert list(buckets["bucket"]) == [0, 1, 2] and set(buckets["collective"]) == {"all_reduce"}
    # buckets of 20,000 fp32 elements (a parameter larger than that is a bucket of its own: 256 KiB)
    # read in KiB, not 0.0xx MiB
    assert "MiB" not in buckets.columns and 1 < buckets["KiB"].min() <= buckets["KiB"].max() < 1024
    assert any("3D x (N-1)/N for a step that reduces once" in m.value for m in at.markdown)
    _page(at, "What-if")
    said = next(i.value for i in at.info if "sharded run (DeepSpeed)" in i.value)
    assert "ZeRO stage" in said and "reduce_bucket_size is not predicted" in said  # its rerun measures it
    _page(at, "Memory (ZeRO)")
    table = next(d.value for d in at.dataframe if "persistent measured/predicted" in d.value.columns)
    assert {"measured (rank 0)", "stage 3", "DeepSpeed estimate (stage 2)"} <= set(table["row"])
    assert any("DeepSpeed's estimator says" in m.value for m in at.markdown)
    _page(at, "Run")
    at.selectbox(key="run_zero_stage").set_value(3).run()
    assert not at.exception
    assert at.button(key="run_button").label == "Rerun at ZeRO stage 3"
    states = next(d.value for d in at.dataframe if "persistent_bytes" in d.value.columns)
    assert list(states[""]) == ["this run (stage 2, rank 0)", "stage 3, predicted"]


@pytest.mark.ddp
def test_the_timeline_says_what_ran_outside_the_buckets_as_the_summary_does(tmp_path, monkeypatch):
    """A run with DDP's unused-parameter map (find_unused_parameters), its buffer broadcast
    (BatchNorm) and the script's own all-reduce of its loss: the Timeline lists each kind
    in the words and numbers `ddpscope summary` prints."""
    from tests.tracer.capture.autotrace.test_autotrace import USER

    at, out = _open_traced(tmp_path, monkeypatch, USER, "--steps", "4", "--depth", "3", "--find-unused",
                           "--batchnorm", "--loss-allreduce", name="own")
    summary = run_cli("summary", str(out)).stdout
    said = [line.strip() for line in summary.split("collectives outside the buckets:", 1)[1].splitlines()
            if line.startswith("  ")]
    assert len(said) == 3, summary
    shown = next(m.value for m in at.markdown if m.value.startswith("**Collectives outside the buckets**"))
    assert [line[2:] for line in shown.splitlines()[1:]] == said


@pytest.mark.deepspeed
def test_a_deepspeed_run_whose_units_share_one_bucket_shows_those_that_communicated(tmp_path, monkeypatch):
    """ZeRO-2 with one bucket for the whole model (1,000,000 elements): the bucket is named
    for its first parameter's unit, so the two other layers issued nothing. The unit table
    leaves them out and says how many; its switch shows every unit."""
    pytest.importorskip("deepspeed")
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS

    at, _ = _open_traced(tmp_path, monkeypatch, str(WORKERS / "deepspeed_train.py"), "--stage", "2", "--steps", "3",
                         "--reduce-bucket-size", "1000000", name="ds1b", env={"DS_ACCELERATOR": "cpu"})

    def units():
        return next(d.value for d in at.dataframe if {"unit", "params"} <= set(d.value.columns))

    assert list(units()["unit"]) == ["(root)", "4", NO_UNIT]  # the bucket opens with the last layer's gradients
    assert any(c.value.startswith("2 more units issued no collective") for c in at.caption)
    at.toggle(key="sharded_every_unit").set_value(True).run()
    assert not at.exception
    assert list(units()["unit"]) == ["(root)", "0", "2", "4", NO_UNIT]


@pytest.mark.ddp
def test_a_zero1_run_shows_its_broadcasts_and_its_stage_on_the_memory_page(tmp_path, monkeypatch):
    """DDP with ZeroRedundancyOptimizer (traced here): the Timeline draws its parameter
    broadcasts and says what they cost; the Memory page sets the run beside stages 0-3."""
    from tests.tracer.capture.ddp.test_hooks import SETUPS

    at, out = _open_traced(tmp_path, monkeypatch, SETUPS, "zero", "--steps", "4", name="zero1")
    assert at.sidebar.selectbox(key="trace").value == "run: zero1"
    assert "parameter broadcast (ZeRO-1)" in {t["name"] for t in _spec(at)["data"]}
    line = next(i.value for i in at.info if "ZeRO-1 (ZeroRedundancyOptimizer)" in i.value)
    summary = run_cli("summary", "--json", str(out))  # the same steps (warm-up left out), the same numbers
    assert summary.returncode == 0, summary.stderr
    said = json.loads(summary.stdout)["zero1"]
    assert f"{said['param_sync_ms']:.2f} ms a step" in line and f"{said['pct_of_step']:.1f} % of the step" in line
    _page(at, "Memory (ZeRO)")
    titles = [json.dumps(c["layout"].get("title")) for c in _charts(at)]
    assert any("beside ZeRO stages 0-3" in t for t in titles)
    table = next(d.value for d in at.dataframe if "measured/predicted" in d.value.columns)
    assert list(table["row"])[-4:] == ["stage 0", "stage 1", "stage 2", "stage 3"]
    assert any("ZeroRedundancyOptimizer partitions whole parameters" in m.value for m in at.markdown)


def test_only_the_open_page_computes_and_a_link_opens_any_page(app):
    """The first chart comes sooner: a page's content is built only while it is open. The
    open page is in the URL (``?page=...``): a link opens that page."""
    assert app.session_state["page"] == "Timeline" and app.get("plotly_chart")
    for key in ("ring_trace", "zero_trace"):  # the Ring and Memory pages: not built
        with pytest.raises(KeyError):
            app.selectbox(key=key)
    linked = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
    linked.query_params["page"] = "Memory (ZeRO)"
    linked.run()
    assert not linked.exception and linked.session_state["page"] == "Memory (ZeRO)"
    assert linked.selectbox(key="zero_trace").value == "sample: zero-gpt-2rank"
    assert not linked.get("download_button")  # the Timeline's Perfetto download: not built


def test_the_sweeps_caption_names_the_fastest_cap_and_why_another_stays_marked():
    """The caption says the table's fastest cap; where it beats the traced cap by under
    MIN_GAIN, the traced one stays marked best (the figure's marker) and the caption says
    why, not that the marked cap is the fastest."""
    import pandas as pd

    from ddpscope.dashboard.whatif_page import sweep_caption
    from ddpscope.viz.whatif.sweep import recommend_cap

    close = pd.DataFrame({"bucket_cap_mb": [1.0, 25.0, 64.0], "step_ms": [99.0, 100.0, 101.0],
                          "exposed_ms": [1.0, 2.0, 3.0], "traced": [False, True, False]})
    best = recommend_cap(close)
    assert best["bucket_cap_mb"] == 25.0  # 1 % better: not worth a change
    text = sweep_caption(close, best, float("nan"))
    assert text.startswith("Of the uniform caps on the curve, 1 MiB is predicted fastest (99.0 ms a step), under 2 % "
                           "faster than the traced 25 MiB (100.0 ms), which stays marked best")
    far = close.assign(step_ms=[80.0, 100.0, 101.0])
    text = sweep_caption(far, recommend_cap(far), float("nan"))
    assert "1 MiB is predicted fastest (80.0 ms a step)." in text and "stays marked" not in text
