"""How the zero-code capture gets into a process, without a job: the bootstrap's
``sitecustomize`` (and the one it shadows), the gate on launched ranks, and the DDP
patch that keeps the class itself (frameworks check ``isinstance``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddpscope.tracer.capture.autotrace.config import CAPTURE_ENV, CaptureConfig
from ddpscope.tracer.launch.runner import BOOTSTRAP, capture_env

PROBE = """
import json, sys
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.nn.parallel.distributed as d
print(json.dumps({"patched": getattr(DDP.__init__, "_ddpscope", False), "same_class": DDP is d.DistributedDataParallel,
                  "marker": getattr(sys, "_other_sitecustomize_ran", False)}))
"""


def _probe(tmp_path, env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", CAPTURE_ENV, "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _capture(tmp_path) -> dict:
    return {**capture_env(), **CaptureConfig(out=str(tmp_path / "out")).to_env()}


def test_a_launched_rank_gets_ddp_patched_in_place(tmp_path):
    seen = _probe(tmp_path, {**_capture(tmp_path), "RANK": "0", "LOCAL_RANK": "0"})
    assert seen["patched"] and seen["same_class"]


@pytest.mark.parametrize("env", [{}, {"RANK": "0"}], ids=["not-a-rank", "no-capture-asked"])
def test_nothing_happens_outside_a_traced_rank(tmp_path, env):
    full = {**_capture(tmp_path)} if not env else {"PYTHONPATH": capture_env()["PYTHONPATH"], **env}
    assert not _probe(tmp_path, full)["patched"]
    assert not (tmp_path / "out").exists()


def test_the_sitecustomize_it_shadows_still_runs(tmp_path):
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys\nsys._other_sitecustomize_ran = True\n")
    env = _capture(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), str(other)])
    seen = _probe(tmp_path, {**env, "RANK": "1"})
    assert seen["marker"] and seen["patched"]


@pytest.mark.parametrize("fields, message", [
    ({"bucket_cap_mb": 0}, "--bucket-cap-mb must be > 0"),
    ({"bucket_cap_mb": float("inf")}, "--bucket-cap-mb must be > 0"),
    ({"steps": 0}, "--steps must be in 1..100000"),
    ({"out": ""}, "--out DIR is required"),
])
def test_capture_config_names_the_flag(fields, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        CaptureConfig(**{"out": "x", **fields})
