"""ddpscope in a user's own environment: the installed package is complete and takes no
name the user's code may own; a user's project with its own ``tracer``, ``viz`` and
``dashboard`` packages is traced and opened as it is.

The ``install`` test builds what a user does: a fresh venv holding only the pinned CPU
torch, ``pip install .`` (not editable), then every command from a folder outside the
repository. It needs the package index and a few minutes, so it is marked ``install``
and run by ``.ci/run`` after the default suite (``pytest -m install``)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import tomllib

from ddpscope.tracer.launch.torchrun import free_port
from tests.conftest import ROOT, SAMPLES

PACKAGES = ("tracer", "viz", "dashboard")  # names a user's project may own too
FOLDERS = ("cli", *PACKAGES)  # every repository folder installed as ddpscope.<folder>
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_folder_is_installed_under_ddpscope():
    """What the repository holds as packages is what pyproject installs, each as
    ``ddpscope.<folder>``; nothing else is installed at the top level."""
    on_disk = sorted("ddpscope." + str(p.parent.relative_to(ROOT)).replace("/", ".")
                     for top in FOLDERS for p in (ROOT / top).rglob("__init__.py"))
    tool = _pyproject()["tool"]["setuptools"]
    assert sorted(tool["packages"]) == on_disk
    assert tool["package-dir"] == {f"ddpscope.{p}": p for p in FOLDERS}
    assert _pyproject()["project"]["scripts"] == {"ddpscope": "ddpscope.cli.main:main"}


def test_every_imported_package_is_a_dependency():
    """Each third-party module the installed code imports (anywhere: a rank, the page, the
    CLI) is named in pyproject's dependencies, so `pip install .` brings it."""
    declared = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in _pyproject()["project"]["dependencies"]}
    imported = set()
    for path in [ROOT / "app.py", *(p for top in FOLDERS for p in (ROOT / top).rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in ("ddpscope", "__future__")}
    assert third_party >= {"torch", "msgspec", "streamlit"}  # the check sees them
    missing = {m for m in third_party if DISTRIBUTIONS.get(m, m).lower() not in declared}
    assert not missing, f"imported but not in pyproject's dependencies: {sorted(missing)}"


USER_TRAIN = '''
import json, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import tracer, viz, dashboard  # the project's own packages
dist.init_process_group("gloo")
owners = {m.__name__: (m.OWNER, m.__file__) for m in (tracer, viz, dashboard)}
model = DDP(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
with open(f"owners-{dist.get_rank()}.json", "w") as f:
    json.dump({"owners": owners, "ddpscope_loaded": sorted(m for m in sys.modules if m.startswith("ddpscope"))}, f)
dist.barrier()
del model
dist.destroy_process_group()
'''

OPEN_IN_DASHBOARD = '''
import json, sys
from streamlit.testing.v1 import AppTest
import tracer, viz, dashboard
at = AppTest.from_file(sys.argv[1], default_timeout=90).run()
labels = at.sidebar.selectbox(key="trace").options
at.sidebar.selectbox(key="trace").set_value("run: mine").run()
print(json.dumps({"exception": [str(e.value) for e in at.exception], "errors": [e.value for e in at.error],
                  "labels": labels, "medians": len(at.dataframe[0].value),
                  "own": [m.OWNER for m in (tracer, viz, dashboard)]}))
'''


def make_user_project(folder: Path) -> Path:
    """A project whose own packages are named ``tracer``, ``viz`` and ``dashboard``, its
    script in ``scripts/`` (the project is found through PYTHONPATH, as such layouts run:
    a name that ddpscope put earlier on the path would win over the project's)."""
    for name in PACKAGES:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f'OWNER = "user: {name}"\n')
    (folder / "scripts").mkdir()
    (folder / "scripts" / "train.py").write_text(USER_TRAIN)
    return folder


def _app_path(python: str) -> str:
    out = subprocess.run([python, "-c", "from ddpscope.cli.dashboard import app_path; print(app_path())"],
                         capture_output=True, text=True, cwd="/", check=True)
    return out.stdout.strip()


def check_user_project(project: Path, ddpscope: list[str], python: str) -> None:
    """Trace the project's script (its folder first on PYTHONPATH, as projects run) and
    open the run in the dashboard from there: the project's packages stay its own."""
    env = {**os.environ, "PYTHONPATH": str(project)}
    proc = subprocess.run([*ddpscope, "run", "--nproc", "2", "-q", "--out", str(project / "runs" / "mine"), "--",
                           "scripts/train.py"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        seen = json.loads((project / f"owners-{rank}.json").read_text())
        assert {k: v[0] for k, v in seen["owners"].items()} == {n: f"user: {n}" for n in PACKAGES}
        assert all(v[1].startswith(str(project)) for v in seen["owners"].values())
        assert "ddpscope.tracer.capture.autotrace.install" in seen["ddpscope_loaded"]  # ddpscope traced it, under its name
    summary = subprocess.run([*ddpscope, "summary", "--json", "runs/mine"], cwd=project, env=env, capture_output=True,
                             text=True, timeout=120)
    assert summary.returncode == 0 and json.loads(summary.stdout)["status"] == "complete", summary.stderr
    (project / "dash.py").write_text(OPEN_IN_DASHBOARD)
    page = subprocess.run([python, "dash.py", _app_path(python)], cwd=project, capture_output=True, text=True,
                          timeout=300, env={**env, "DDPSCOPE_RUNS_DIR": str(project / "runs")})
    assert page.returncode == 0, page.stderr[-3000:]
    seen = json.loads(page.stdout.strip().splitlines()[-1])
    assert not seen["exception"] and not seen["errors"], seen
    assert "run: mine" in seen["labels"] and seen["medians"] == 2
    assert seen["own"] == [f"user: {n}" for n in PACKAGES]


@pytest.mark.ddp
@pytest.mark.breadth  # the install suite checks the same project against a pip-installed ddpscope
def test_a_user_project_with_packages_named_like_ddpscopes_folders(tmp_path):
    check_user_project(make_user_project(tmp_path / "project"), [sys.executable, "-m", "ddpscope.cli"],
                       sys.executable)


def _torch_record(python: Path) -> str:
    code = "import importlib.metadata as m; d = m.distribution('torch'); print(d.version, d.read_text('RECORD'))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout
    return hashlib.sha256(out.encode()).hexdigest()


@pytest.mark.install
def test_pip_install_into_a_venv_that_holds_only_torch(tmp_path):
    """A user's environment: a venv with only the pinned CPU torch, then `pip install .`.
    Every command works from another folder, torch is the same afterwards, and a project
    with its own tracer/viz/dashboard packages is traced and opened."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=900)
    before = _torch_record(py)
    subprocess.run([*pip, str(ROOT)], check=True, timeout=900, cwd="/")
    assert _torch_record(py) == before, "installing ddpscope changed the user's torch"
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True).stdout
    assert "ddpscope" in {p["name"] for p in json.loads(listed)}
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not any((Path(site) / name).exists() for name in (*FOLDERS, "app.py")), "a generic name was installed"
    ddpscope = str(venv / "bin" / "ddpscope")
    work = tmp_path / "elsewhere"
    work.mkdir()

    demo = subprocess.run([ddpscope, "run", "--demo", "mlp", "--steps", "3", "--out", "runs/demo"], cwd=work,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr
    assert "compiled capture could not be built" not in demo.stderr  # the C++ source came along
    installed_samples = venv / "share" / "ddpscope" / "samples"
    for sample in sorted(p.name for p in SAMPLES.iterdir() if p.is_dir()):  # not samples/README.md
        proc = subprocess.run([ddpscope, "summary", str(installed_samples / sample)], cwd=work, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and "status=complete" in proc.stdout, (sample, proc.stderr)

    port = free_port()
    server = subprocess.Popen([ddpscope, "dashboard", "runs", "--port", str(port)], cwd=work,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        health = page = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and health != "ok":
            time.sleep(1)
            try:
                health = urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=5).read().decode()
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).status
            except OSError:
                continue
        assert health == "ok" and page == 200, server.stderr.read() if server.poll() is not None else "no answer"
    finally:
        server.terminate()
        server.wait(timeout=30)

    check_user_project(make_user_project(tmp_path / "project"), [ddpscope], str(py))
    assert _torch_record(py) == before
