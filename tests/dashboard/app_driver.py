"""Driving the dashboard in Streamlit's AppTest, shared by the page tests: open a page,
read its charts, tables and metrics, wait for a job it started, and open it on a run
traced for real."""

from __future__ import annotations

import io
import json
import time
import zipfile

from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT, SAMPLES

# the Timeline page's tables, in the order it draws them: medians, per step, stragglers, buckets
MEDIANS, BUCKETS = 0, 3


def open_page(at, label: str):
    """Open one page of the dashboard (only the open page computes) and run."""
    at.session_state["page"] = label
    return at.run()


def chart_spec(at, n=0):
    return json.loads(at.get("plotly_chart")[n].proto.spec)


def metric_value(at, label):
    return next(m.value for m in at.metric if m.label == label)


def open_traced(tmp_path, monkeypatch, *script: str, name: str, **trace_kw):
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


def zip_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def wait_for_job(app, timeout=150):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        app.run()
        assert not app.exception
        if not app.get("progress"):
            return
    raise AssertionError("the run did not finish")


def chart_specs(app) -> list[dict]:
    return [json.loads(c.proto.spec) for c in app.get("plotly_chart")]


def script_run(folder, argv, cwd="/tmp", nproc=2):
    """A copy of a sample that says it came from ``ddpscope run -- argv`` (no run needed)."""
    folder.mkdir(parents=True)
    for p in (SAMPLES / "gpt-2rank-cap1mb").iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    run = json.loads((folder / "run.json").read_text())
    run.pop("model", None)
    run.update(script={"argv": argv, "module": False, "path": str(ROOT / argv[0]), "cwd": cwd, "sha256": None},
               nproc_per_node=nproc, demo=None)
    (folder / "run.json").write_text(json.dumps(run))


def chart_titled(app, title_part: str) -> dict:
    for c in app.get("plotly_chart"):
        spec = json.loads(c.proto.spec)
        if title_part in json.dumps(spec["layout"].get("title")) or title_part in json.dumps(spec["layout"].get("yaxis")):
            return spec
    raise AssertionError(f"no chart with {title_part!r}")


def table_with(app, column: str):
    return next(d.value for d in app.dataframe if column in d.value.columns)
