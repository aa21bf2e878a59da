"""The dashboard's list of traces (dashboard/catalog.py, dashboard/loaders.py) with AppTest: the
runs folder, the samples, uploads of runs, archives and summaries, and what a run that cannot
be read, is unfinished or holds no finished step shows instead of a traceback."""

from __future__ import annotations

import gzip
import json
import shutil
import time

import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT, SAMPLES
from tests.dashboard.app_driver import MEDIANS, chart_spec, metric_value, zip_bytes
from tests.viz.sources.test_kineto import gpu_profile


def test_an_upload_cut_short_while_written_opens_as_the_steps_it_holds(app, mlp_run):
    """A rank file is written as it goes (format version 2: an event array): one cut short (a
    run killed while writing, a copy taken mid-run) is read up to its last whole event and
    the run shows as unfinished, saying which rank stopped where; nothing is refused, nothing
    raised. (A version-1 object cut short is refused: the trunc.zip case below.)"""
    files = {p.name: p.read_bytes() for p in mlp_run[0].iterdir() if p.name.endswith(".json")}
    assert files["rank-0.json"].startswith(b"[")
    files["rank-0.json"] = files["rank-0.json"][:5000]
    app.sidebar.file_uploader(key="upload").upload("cut.zip", zip_bytes(files))
    app.run()
    assert not app.exception and not app.sidebar.error
    assert not app.sidebar.selectbox(key="trace").value.startswith("sample:")  # the upload is open
    notes = " ".join(w.value for w in app.warning)
    assert "the trace was not finished (rank 0 after step 0)" in notes, notes


def test_upload_of_a_run_archive_opens_it(app):
    files = {f"gpt/{p.name}": p.read_bytes() for p in (SAMPLES / "gpt-2rank-cap25mb").iterdir()}
    app.sidebar.file_uploader(key="upload").upload("my-run.zip", zip_bytes(files), "application/zip")
    app.run()
    assert not app.exception and not app.sidebar.error
    assert app.sidebar.selectbox(key="trace").value.startswith("upload: my-run-")
    assert metric_value(app, "buckets") == "1"


def test_an_upload_of_summaries_only_opens_as_the_runs_folder_would(app, mlp_run):
    """The many-rank format (run.json and each rank's summary, no events) opens from the
    runs folder; uploaded, it opens too, rather than "has neither events nor a summary"."""
    files = {f"many/{p.name}": p.read_bytes() for p in mlp_run[0].iterdir()
             if p.name == "run.json" or p.name.endswith(".summary.jsonl")}
    app.sidebar.file_uploader(key="upload").upload("many.zip", zip_bytes(files), "application/zip")
    app.run()
    assert not app.exception and not app.sidebar.error
    assert app.sidebar.selectbox(key="trace").value.startswith("upload: many-")
    assert app.dataframe[MEDIANS].value is not None and len(app.dataframe[MEDIANS].value) == 2  # both ranks


def test_uploads_of_one_file_never_remove_each_other(tmp_path, monkeypatch):
    """The same archive uploaded twice (two tabs, the same second), then a bad one of the
    same name: both good uploads stay, each in a folder of its own; the bad one leaves
    nothing and removes nothing it did not make."""
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    good = zip_bytes({f"gpt/{p.name}": p.read_bytes() for p in (SAMPLES / "gpt-2rank-cap25mb").iterdir()})
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
    ("empty.zip", lambda: zip_bytes({"readme.txt": b"hi"}), "holds no rank-<r>.json"),
    # a Chrome-trace object (format version 1, as the samples are, or a profiler's) cut short cannot be read
    ("trunc.zip", lambda: zip_bytes({"rank-0.json": (SAMPLES / "mlp-2rank-cap1mb" / "rank-0.json").read_bytes()[:5000],
                                "rank-1.json": (SAMPLES / "mlp-2rank-cap1mb" / "rank-1.json").read_bytes()}),
     "is not valid JSON (truncated"),
    ("kineto.zip", lambda: zip_bytes({"rank-0.json": json.dumps({"traceEvents": [], "schemaVersion": 1}).encode()}),
     "holds no timed events"),
    ("trunc.json.gz", lambda: gzip.compress(json.dumps(gpu_profile(0)).encode())[:-100],
     "truncated or corrupt gzip"),
    ("half.zip", lambda: zip_bytes({"rank-0.json": (SAMPLES / "mlp-2rank-cap1mb" / "rank-0.json").read_bytes(),
                               "run.json": (SAMPLES / "mlp-2rank-cap1mb" / "run.json").read_bytes()}),
     "rank 1 of 2 are missing"),
    ("evil.zip", lambda: zip_bytes({"../../escape/rank-0.json": b"{}"}), "unsafe path"),
    ("surrogate.zip", lambda: zip_bytes(_sample_with("mlp-2rank-cap1mb", "rank-0.json", b'"layers.0.weight"', b'"layers.0.\\ud800"')),
     "rank-0.json is not valid JSON"),
    ("version.zip", lambda: zip_bytes(_sample_with("mlp-2rank-cap1mb", "run.json", b'"version": 1', b'"version": "abc"')),
     "is not a version number"),
    ("digits.zip", lambda: zip_bytes(_sample_with("gpt-2rank-cap1mb", "run.json", b'"world_size": 2',
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
    assert metric_value(at, "status") == "incomplete"
    assert any("rank 1 after step 4" in w.value for w in at.warning)
    assert at.get("plotly_chart") and at.dataframe[MEDIANS].value is not None


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
    assert chart_spec(at)["data"]


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
