"""Traces that are not what they claim: seeded mutations of the samples (and of a
written profiler trace) go through every loader, metric and figure, and nothing but a
one-line ``TraceError`` may come out."""

from __future__ import annotations

import collections
import json
import random
import shutil
import traceback
import warnings
from pathlib import Path

from ddpscope.viz.buckets import compute_bucket_table
from ddpscope.viz.gantt import make_timeline_figure
from ddpscope.viz.overlap import (
    compute_ddp_logging_view,
    compute_rank_medians,
    compute_run_comparison,
    compute_step_breakdown,
)
from ddpscope.viz.ring import compute_ring_summary
from ddpscope.viz.ring_trace import load_ring
from ddpscope.viz.sources import folder_kind, load_training_trace
from ddpscope.viz.stragglers import compute_straggler_summary
from ddpscope.viz.trace import TraceError
from ddpscope.viz.zero_trace import compute_zero_comparison, load_zero
from tests.conftest import SAMPLES
from tests.test_kineto import gpu_profile

CASES = 300
ODD = ["x", "", 0, -1, 1e308, -1e308, 10**30, None, float("nan"), float("inf"), True, [], {}, [1, 2], {"a": 1}, [[[]]]]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:60]):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, rng: random.Random):
    p = rng.choice([p for p in _paths(obj) if p])
    parent = obj
    for k in p[:-1]:
        parent = parent[k]
    key = p[-1]
    op = rng.choice(["remove", "type", "type", "duplicate", "reorder", "range"])
    if op == "remove":
        parent.pop(key)
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(parent[key])))
    elif op == "reorder" and isinstance(parent, list):
        rng.shuffle(parent)
    elif op == "range" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = rng.choice([-5, 10**6, 2**40, 10**12, 3])  # indices, world sizes, steps out of range
    else:
        parent[key] = rng.choice(ODD)


def _make_case(src: Path, dst: Path, rng: random.Random) -> str:
    shutil.copytree(src, dst)
    files = sorted(p for p in dst.iterdir() if p.name.endswith((".json", ".json.gz")))
    f = rng.choice(files)
    r = rng.random()
    if r < 0.08:
        data = f.read_bytes()
        f.write_bytes(data[:rng.randrange(len(data))])
        return "truncated"
    if r < 0.16:
        data = bytearray(f.read_bytes())
        data[rng.randrange(len(data))] = rng.randrange(256)
        f.write_bytes(bytes(data))
        return "byte flip"
    if r < 0.2:
        f.unlink()
        return "missing file"
    if r < 0.24:
        shutil.copy(files[-1], dst / "rank-7.json")
        return "extra rank file"
    if f.name.endswith(".gz"):
        return "unchanged"
    obj = json.loads(f.read_text())
    if r < 0.3 and isinstance(obj, dict) and "world_size" in obj:
        obj["world_size"] = rng.choice([1, 3, 10**12, -2, "two"])
        what = "world size"
    elif r < 0.36 and isinstance(obj.get("otherData"), dict):
        meta = obj["otherData"]["ddpscope"]
        meta["clock_offset"] = {"start": {"offset_us": rng.choice([1e300, "x", None, -1e15]), "at_us": 0}, "end": None}
        what = "clock offset"
    else:
        for _ in range(rng.randint(1, 3)):
            _mutate(obj, rng)
        what = "mutation"
    f.write_text(json.dumps(obj))
    return what


def _everything(path: Path) -> None:
    kind = folder_kind(path)
    if kind == "ring":
        compute_ring_summary(load_ring(path))
    elif kind == "zero":
        compute_zero_comparison(load_zero(path))
    else:
        t = load_training_trace(path)
        compute_rank_medians(t)
        compute_step_breakdown(t, include_warmup=True)
        compute_bucket_table(t)
        compute_ddp_logging_view(t)
        compute_straggler_summary(t)
        compute_run_comparison({"a": t})
        make_timeline_figure(t).to_json()


def test_mutated_traces_raise_nothing_but_trace_error(tmp_path):
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "rank-0.json").write_text(json.dumps(gpu_profile(0)))
    (profile / "rank-1.json").write_text(json.dumps(gpu_profile(1, shift=3.0)))
    sources = [p for p in SAMPLES.iterdir() if p.is_dir()] + [profile]
    rng = random.Random(20261122)
    escaped: collections.Counter = collections.Counter()
    example = {}
    for n in range(CASES):
        src = rng.choice(sources)
        dst = tmp_path / f"case{n}"
        what = _make_case(src, dst, rng)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _everything(dst)
        except TraceError as e:
            assert "\n" not in str(e)
        except Exception as e:  # noqa: BLE001 - counted, then reported below
            frame = traceback.extract_tb(e.__traceback__)[-1]
            key = f"{type(e).__name__} at {Path(frame.filename).name}:{frame.lineno}"
            escaped[key] += 1
            example.setdefault(key, f"{src.name} ({what}): {str(e)[:200]}")
        shutil.rmtree(dst)
    assert not escaped, {k: (c, example[k]) for k, c in escaped.items()}
