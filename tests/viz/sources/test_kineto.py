"""Profiler (Kineto) traces: real GPU-cluster traces against Holistic Trace Analysis'
figures, the timeline and merge, and bad input. Tests that read ``../shared`` skip
without it; the small traces made here are written by the tests (never copied)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ddpscope.viz.ddp.gantt import make_timeline_figure
from ddpscope.viz.ddp.kernel_gantt import make_kernel_timeline_figure
from ddpscope.viz.ddp.kernel_overlap import compute_hta_breakdown, compute_kernel_step_breakdown
from ddpscope.viz.ddp.overlap import compute_rank_medians
from ddpscope.viz.intervals import intersection, merge_intervals
from ddpscope.viz.perfetto import merge_run
from ddpscope.viz.sources import KINETO as KIND
from ddpscope.viz.sources import MIXED, folder_kind, kineto_file, load_training_trace
from ddpscope.viz.trace import TraceError
from tests.conftest import KINETO, SAMPLES

shared = pytest.mark.skipif(not KINETO.is_dir(), reason="../shared/data/kineto is absent")

# Printed by Holistic Trace Analysis 0.5.0 (TraceAnalysis(trace_dir=...) defaults), from
# ../shared/data/kineto/README.md: overlap %, idle %, compute %, non-compute %.
HTA = {
    ("hta-sampled-2rank", 0): (11.81, 53.56, 17.71, 28.74),
    ("hta-sampled-2rank", 1): (20.05, 54.72, 22.57, 22.72),
    ("hta-allreduce-rank0", 0): (14.31, 77.78, 17.26, 4.97),
}


def summary_json(path: Path) -> tuple[int, dict | str]:
    proc = subprocess.run([sys.executable, "-m", "ddpscope.cli", "summary", "--json", str(path)], cwd="/",
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin"})
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr)


@shared
@pytest.mark.parametrize("folder", ["hta-sampled-2rank", "hta-allreduce-rank0"])
def test_summary_json_agrees_with_hta_per_rank(folder):
    code, out = summary_json(KINETO / folder)
    assert code == 0, out
    assert out["source"] == "kineto"
    ranks = sorted(r for (f, r) in HTA if f == folder)
    assert sorted(map(int, out["hta"])) == ranks
    for r in ranks:
        got = out["hta"][str(r)]
        overlap, idle, compute, non_compute = HTA[(folder, r)]
        assert abs(got["comp_comm_overlap_pct"] - overlap) <= 0.1
        assert abs(got["idle_pct"] - idle) <= 0.5
        assert abs(got["compute_pct"] - compute) <= 0.5
        assert abs(got["non_compute_pct"] - non_compute) <= 0.5


@shared
def test_sampled_ranks_open_with_their_job_size_and_align():
    t = load_training_trace(KINETO / "hta-sampled-2rank")
    assert t.source == "kineto" and t.world_size == 128 and t.run["ranks_present"] == [0, 1]
    assert any("2 of the job's 128 ranks" in n for n in t.run["notes"])
    assert sorted(t.steps["step"].unique()) == [551, 552]
    # only send/recv ran: nothing that ends together on every rank, and the page says so
    assert t.run["clock"]["residual_skew_us"] is None and "unknown" in t.run["clock"]["note"]
    k = t.kernels
    assert set(k.loc[k["kind"] == "comm", "collective"]) == {"sendrecv"}
    # every kernel of a step was launched inside that step's CPU span
    launched = k[k["step"] >= 0].merge(t.steps, on=["rank", "step"], suffixes=("", "_step"))
    assert ((launched["launch_us"] >= launched["start_us_step"]) & (launched["launch_us"] < launched["end_us_step"])).all()


@shared
def test_allreduces_of_a_ddp_step_are_its_buckets_with_bytes_from_the_kernel_args():
    t = load_training_trace(KINETO / "hta-allreduce-rank0")
    b = t.buckets
    assert sorted(b["step"].unique()) == [4, 5, 6]
    per_step = [g.sort_values("bucket")["bytes"].tolist() for _, g in b.groupby("step")]
    assert len(per_step[0]) == 5 and per_step[0] == per_step[1] == per_step[2]  # the same buckets every step
    # 4 bytes per float element, as the NCCL kernel's args say
    raw = json.loads(gzip.open(KINETO / "hta-allreduce-rank0" / "rank-0.json.gz").read())["traceEvents"]
    nelems = sorted(e["args"]["In msg nelems"] * 4 for e in raw
                    if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_AllReduce"))
    assert sorted(b["bytes"]) == nelems
    assert (b["group_size"] == 2).all() and (b["dtype"] == "Float").all()
    steps = compute_kernel_step_breakdown(t)
    assert (steps["buckets"] == 5).all()
    assert ((steps["overlapped_ms"] + steps["exposed_ms"] - steps["comm_ms"]).abs() < 1e-9).all()
    assert (steps["overlapped_ms"] <= steps["comm_ms"]).all() and (steps["compute_ms"] <= steps["step_ms"]).all()


@shared
def test_timeline_lanes_per_collective_kind_and_stream():
    t = load_training_trace(KINETO / "hta-allreduce-rank0")
    fig = make_timeline_figure(t, steps=[5])  # the figure every page calls dispatches on the source
    lanes = list(fig.layout.yaxis.ticktext)
    assert lanes == ["rank 0 · compute", "rank 0 · allreduce", "rank 0 · broadcast", "rank 0 · memcpy / other",
                     "rank 0 · exposed comm"]
    names = {d.name for d in fig.data}
    assert {"compute kernels", "allreduce", "exposed communication (no compute beside it)"} <= names
    ar = next(d for d in fig.data if d.name == "allreduce")
    assert len(ar.x) == 5  # one bar per all-reduce kernel of step 5
    # the exposed bars are the all-reduce time with no compute kernel beside it
    k = t.kernels[t.kernels["step"] == 5]
    comm = merge_intervals(k.loc[k["kind"] == "comm", "start_us"].to_numpy(), k.loc[k["kind"] == "comm", "end_us"].to_numpy())
    comp = merge_intervals(t.kernels.loc[t.kernels["kind"] == "compute", "start_us"].to_numpy(),
                           t.kernels.loc[t.kernels["kind"] == "compute", "end_us"].to_numpy())
    exposed = next(d for d in fig.data if d.name.startswith("exposed"))
    want = (comm[:, 1] - comm[:, 0]).sum() - intersection(comm, comp)
    assert np.isclose(np.asarray(exposed.x).sum() * 1e3, want, rtol=1e-6)
    per_stream = make_kernel_timeline_figure(t, steps=[5], per_stream=True)
    assert "rank 0 · stream 7" in list(per_stream.layout.yaxis.ticktext)


@shared
def test_perfetto_merge_names_every_process_by_rank():
    merged = merge_run(KINETO / "hta-sampled-2rank")
    names = [e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"]
    assert any(n.startswith("rank 0 · ") for n in names) and any(n.startswith("rank 1 · ") for n in names)
    pids = {(e["args"]["name"], e["pid"]) for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert len({p for _, p in pids}) == len(pids)  # no two ranks share a process id


def test_intersection_matches_a_brute_force_count():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = merge_intervals(*(lambda s: (s, s + rng.integers(1, 20, len(s))))(rng.integers(0, 200, 15)))
        b = merge_intervals(*(lambda s: (s, s + rng.integers(1, 20, len(s))))(rng.integers(0, 200, 15)))
        grid = np.arange(0, 230) + 0.5
        inside = lambda iv: ((grid[:, None] >= iv[:, 0]) & (grid[:, None] < iv[:, 1])).any(axis=1)  # noqa: E731
        assert intersection(a, b) == (inside(a) & inside(b)).sum()


# -- small profiles written here -------------------------------------------------------------

def _kernel(name, ts, dur, corr, stream=7, **args):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr, **args}}


def _launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def _step(n, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def gpu_profile(rank: int, world: int = 2, comm: bool = True, shift: float = 0.0) -> dict:
    """Two steps of 1000 µs: a compute kernel 0-400 µs, an all-reduce 300-600 µs."""
    ev = []
    for i, step in enumerate((1, 2)):
        t0 = 1000.0 * i
        ev += [_step(step, t0 + shift, 1000), _launch(t0 + 10 + shift, 10 * i + 1),
               _kernel("void gemm_kernel<float>()", t0 + 20 + shift, 400, 10 * i + 1)]
        if comm:
            ev += [_launch(t0 + 20 + shift, 10 * i + 2),
                   _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", t0 + 320 + shift,
                           300, 10 * i + 2, stream=20, **{"Collective name": "allreduce", "In msg nelems": 1024,
                                                          "dtype": "Float", "Group size": world})]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "traceEvents": ev}


def write(folder: Path, name: str, data, gz: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(data).encode() if not isinstance(data, bytes) else data
    (folder / name).write_bytes(gzip.compress(raw) if gz else raw)
    return folder / name


def test_a_written_profile_loads_with_the_overlap_it_was_built_with(tmp_path):
    write(tmp_path, "rank-0.json.gz", gpu_profile(0), gz=True)
    write(tmp_path, "worker1.123.pt.trace.json", gpu_profile(1, shift=7.0))
    assert folder_kind(tmp_path) == KIND
    t = load_training_trace(tmp_path)
    steps = compute_kernel_step_breakdown(t)
    # compute 20-420, all-reduce 320-620 in each step: 100 of 300 µs overlapped
    assert np.allclose(steps["overlap_pct"], 100 / 3) and np.allclose(steps["exposed_ms"], 0.2)
    # ranks aligned by the all-reduces' ends: rank 1's 7 µs shift is taken out exactly
    assert t.run["clock"]["offsets_us"]["1"] == pytest.approx(-7.0) and t.run["clock"]["residual_skew_us"] == 0
    hta = compute_hta_breakdown(t)  # HTA leaves the last step out: step 1 only
    assert np.allclose(hta["comp_comm_overlap_pct"], 100 / 3) and np.allclose(hta["kernel_us"], 600)
    assert np.allclose(hta["idle_pct"], 0) and np.allclose(hta["compute_pct"], 400 / 6)
    assert set(t.buckets["bytes"]) == {4096.0}


def test_profile_without_communication_opens_and_says_so(tmp_path):
    write(tmp_path, "rank-0.json", gpu_profile(0, world=1, comm=False))
    t = load_training_trace(tmp_path)
    assert any("no communication" in n for n in t.run["notes"])
    assert compute_rank_medians(t)["overlap_pct"].isna().all()
    assert len(make_timeline_figure(t).data) == 1  # compute only


@pytest.mark.parametrize("with_ids", [False, True])
def test_gpu_side_copies_of_profiler_steps_are_neither_steps_nor_kernels(tmp_path, with_ids):
    """Kineto on CUDA (seen with torch 2.11 on an H200) copies each record_function range,
    ProfilerStep#N included, onto the streams that ran its kernels (``gpu_user_annotation``):
    the profile reads as it would without them."""
    plain = gpu_profile(0)
    write(tmp_path / "plain", "rank-0.json", plain)
    copies = [{**e, "cat": "gpu_user_annotation", "pid": 0, "tid": 7,
               "args": {"External id": 1, **({"stream": 7, "correlation": 99} if with_ids else {})}}
              for e in plain["traceEvents"] if e["name"].startswith("ProfilerStep")]
    write(tmp_path / "copied", "rank-0.json", {**plain, "traceEvents": plain["traceEvents"] + copies})
    want, got = (load_training_trace(tmp_path / k) for k in ("plain", "copied"))
    assert len(copies) == 2 and len(got.steps) == 2
    pd.testing.assert_frame_equal(got.steps, want.steps)
    pd.testing.assert_frame_equal(got.kernels, want.kernels)
    pd.testing.assert_frame_equal(compute_kernel_step_breakdown(got), compute_kernel_step_breakdown(want))


def test_cpu_only_profile_reads_cpu_ops_as_compute(tmp_path):
    ev = [_step(1, 0, 1000), _step(2, 1000, 1000),
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 100, "dur": 300},
          {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 9, "ts": 300, "dur": 200,
           "args": {"Input Dims": [[256, 4]], "Input type": ["float"]}}]
    write(tmp_path, "rank-0.json", {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1},
                                     "traceEvents": ev})
    t = load_training_trace(tmp_path)
    assert t.run["cpu_only"] and any("CPU-only" in n for n in t.run["notes"])
    s = compute_kernel_step_breakdown(t)
    assert s.loc[s["step"] == 1, "overlap_pct"].item() == pytest.approx(50.0)
    assert t.buckets["bytes"].tolist() == [4096.0]


@pytest.mark.parametrize("case, message", [
    ("truncated_gzip", "truncated or corrupt gzip"),
    ("rank_mismatch", "says rank 0 in its distributedInfo but its name says rank 1"),
    ("same_rank", "are both rank 0"),
    ("world_mismatch", "disagree on the job's world size"),
    ("rank_outside", "outside a job of 2 ranks"),
    ("wrong_type", "is not a profiler trace"),
    ("not_json", "not valid JSON"),
    ("over_cap", "over the 1 MiB limit"),
    ("mixed", "mixes ddpscope rank files and profiler traces"),
    ("no_events", "holds no timed events"),
    ("nan_time", "not valid JSON"),
    ("huge_time", "Number out of range"),
])
def test_bad_profiles_are_one_line_on_the_cli(tmp_path, monkeypatch, case, message):
    d = tmp_path / case
    good = json.dumps(gpu_profile(0)).encode()
    if case == "truncated_gzip":
        write(d, "rank-0.json.gz", gzip.compress(good)[:-200])
    elif case == "rank_mismatch":
        write(d, "rank-1.json", gpu_profile(0))
    elif case == "same_rank":
        write(d, "a.json", gpu_profile(0))
        write(d, "b.json", gpu_profile(0))
    elif case == "world_mismatch":
        write(d, "rank-0.json", gpu_profile(0, world=2))
        write(d, "rank-1.json", gpu_profile(1, world=4))
    elif case == "rank_outside":
        write(d, "rank-3.json", gpu_profile(3, world=2))
    elif case == "wrong_type":
        p = gpu_profile(0)
        p["traceEvents"][2]["args"]["stream"] = "seven"
        write(d, "rank-0.json", p)
    elif case == "not_json":
        write(d, "rank-0.json", good[:-40])
    elif case == "over_cap":
        p = gpu_profile(0)
        p["padding"] = "x" * (2 * 2**20)
        write(d, "rank-0.json.gz", p, gz=True)  # 2 MiB of JSON, a few KiB of gzip
    elif case == "mixed":
        for f in (SAMPLES / "mlp-2rank-cap1mb").iterdir():
            if f.is_file():
                write(d, f.name, f.read_bytes())
        write(d, "worker0.pt.trace.json", gpu_profile(0))
    elif case == "no_events":
        write(d, "rank-0.json", {"schemaVersion": 1, "traceEvents": []})
    elif case == "huge_time":
        write(d, "rank-0.json", good.replace(b'"ts": 20.0', b'"ts": 1e999', 1))
    elif case == "nan_time":
        write(d, "rank-0.json", good.replace(b'"ts": 20.0', b'"ts": NaN', 1))
    if case == "over_cap":
        monkeypatch.setattr(kineto_file, "MAX_FILE_BYTES", 2**20)
        with pytest.raises(TraceError, match=message):
            load_training_trace(d)
        return
    with pytest.raises(TraceError, match=message):
        load_training_trace(d)
    code, err = summary_json(d)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_folder_kind_tells_every_kind_apart(tmp_path):
    assert folder_kind(SAMPLES / "gpt-2rank-cap1mb") == "ddp"
    assert folder_kind(SAMPLES / "ring-4rank-4mb") == "ring"
    write(tmp_path / "p", "rank-0.json", gpu_profile(0))  # a profiler trace named like ours
    assert folder_kind(tmp_path / "p") == KIND
    (tmp_path / "empty").mkdir()
    assert folder_kind(tmp_path / "empty") is None
    d = tmp_path / "m"
    write(d, "run.json", json.loads((SAMPLES / "mlp-2rank-cap1mb" / "run.json").read_text()))
    write(d, "rank-0.json", (SAMPLES / "mlp-2rank-cap1mb" / "rank-0.json").read_bytes())
    write(d, "trace.json.gz", gpu_profile(0), gz=True)
    assert folder_kind(d) == MIXED


def test_decoding_piece_by_piece_reads_what_one_piece_reads(tmp_path, monkeypatch):
    """Pieces cut between events, and cuts that land inside a string (a kernel name with
    ``}, {`` in it) wait for the next piece: the columns equal those of one decode."""
    p = gpu_profile(0)
    for i in range(300):
        p["traceEvents"].append(_kernel("void f<{lambda()#1}, {x}>(}, {\"ph\": \"X\"})", 5000 + i, 1, 1000 + i))
        p["traceEvents"].append({"ph": "f", "id": i, "pid": 0, "tid": 7, "ts": 5000 + i, "cat": "ac2g", "name": "ac2g"})
    f = write(tmp_path / "a", "rank-0.json.gz", gzip.compress(json.dumps(p, indent=1).encode()))
    whole = kineto_file.read_kineto_file(f)
    monkeypatch.setattr(kineto_file, "CHUNK_BYTES", 97)
    pieces = kineto_file.read_kineto_file(f)
    for table in ("ops", "gpu"):
        a, b = getattr(whole, table), getattr(pieces, table)
        for key in a:
            if key == "shapes":
                assert a[key] == b[key]
            else:
                x, y = np.asarray(a[key]), np.asarray(b[key])
                assert x.shape == y.shape and (pd.isna(x) == pd.isna(y)).all(), (table, key)
                assert (x[~pd.isna(x)] == y[~pd.isna(y)]).all(), (table, key)
    assert len(pieces.gpu["ts"]) == 2 + 2 + 300 and pieces.rank == 0 and pieces.world_size == 2


def test_gzip_members_and_the_cap_on_bytes_really_inflated(tmp_path, monkeypatch):
    raw = json.dumps(gpu_profile(0)).encode()
    half = len(raw) // 2
    f = write(tmp_path / "m", "rank-0.json.gz", gzip.compress(raw[:half]) + gzip.compress(raw[half:]))
    assert len(kineto_file.read_kineto_file(f).gpu["ts"]) == 4  # `cat a.gz b.gz` is one gzip file
    bomb = write(tmp_path / "b", "rank-0.json.gz", gzip.compress(raw[:-1] + b" " * (8 * 2**20) + b"}"))
    monkeypatch.setattr(kineto_file, "MAX_FILE_BYTES", 2**20)  # the header never claims a size here
    with pytest.raises(TraceError, match="over the 1 MiB limit once decompressed"):
        kineto_file.read_kineto_file(bomb)


def test_gloo_on_cuda_tensors_takes_communication_from_the_cpu_side(tmp_path):
    p = gpu_profile(0, world=1, comm=False)
    p["traceEvents"] += [{"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 9,
                          "ts": ts, "dur": 300, "args": {"Input Dims": [[1024]], "Input type": ["float"]}}
                         for ts in (320.0, 1320.0)]
    write(tmp_path, "rank-0.json", p)
    t = load_training_trace(tmp_path)
    assert t.buckets["bytes"].tolist() == [4096.0, 4096.0] and sorted(t.buckets["step"]) == [1, 2]
    assert not any("no communication" in n for n in t.run["notes"])
    comm = t.kernels[t.kernels["kind"] == "comm"]
    assert (comm["stream"] < 0).all() and not comm["hta"].any()  # HTA counts GPU events only
    assert np.isnan(compute_hta_breakdown(t)["comp_comm_overlap_pct"]).all()


# -- HTA 0.5.0's rounding rule, on a trace built by hand ------------------------------------------

def _rounding_profile(ts_as_float: bool, drop_ts: bool = False) -> bytes:
    """One rank, two ProfilerSteps; in the first, a compute kernel of dur 10.6 overlapping an
    NCCL kernel of dur 10 by 5.6 µs (5 once HTA rounds the compute kernel's end down)."""
    t = float if ts_as_float else int
    ev = [_step(1, t(1000), 100), _launch(t(1010), 1), _kernel("void gemm_kernel<float>()", t(1020), 10.6, 1),
          _launch(t(1012), 2), _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                                       t(1025), 10, 2, stream=20),
          _step(2, t(1100), 100)]
    meta = {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}}
    if not drop_ts:
        meta["ts"] = t(0)
    text = json.dumps({"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
                       "traceEvents": [meta, *ev]})
    assert ("1020.0" in text) == ts_as_float  # json writes a float ts with its ".0", as Kineto does
    return text.encode()


@pytest.mark.parametrize("ts_as_float, drop_ts, disabled, hta", [
    (True, False, False, 50.0),  # whole numbers written as floats: pandas' ts is float64, HTA rounds
    (False, False, False, 56.0),  # integers: int64, no rounding
    (False, True, False, 50.0),  # integers, but one event without ts: NaN makes it float64
    (True, False, True, 56.0),  # HTA_DISABLE_NS_ROUNDING=1: HTA's own switch
])
def test_hta_figures_follow_htas_rounding_rule_and_ours_stay_beside(tmp_path, monkeypatch, ts_as_float, drop_ts,
                                                                    disabled, hta):
    if disabled:
        monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    else:
        monkeypatch.delenv("HTA_DISABLE_NS_ROUNDING", raising=False)
    write(tmp_path, "rank-0.json", _rounding_profile(ts_as_float, drop_ts))
    table = compute_hta_breakdown(load_training_trace(tmp_path)).iloc[0]
    assert table["comp_comm_overlap_pct"] == pytest.approx(hta)
    assert bool(table["hta_rounded"]) == (hta == 50.0)
    assert table["ddpscope_overlap_pct"] == pytest.approx(56.0)  # ddpscope's own: ns kept


def test_htas_communication_kernels_are_named_by_its_own_rule():
    from ddpscope.viz.sources.kineto import HTA_COMM_RE, kernel_kind

    for name, ours, htas in [
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "comm", "comm"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "comm", "comm"),
        ("nccl:all_reduce", "comm", "compute"),  # HTA 0.5.0: ^nccl.*Kernel only
        ("hipKernel_fused", "comm", "compute"),
        ("Memcpy DtoD (Device -> Device)", "memory", "memory"),
        ("cudaDeviceSynchronize", "other", "other"),
    ]:
        assert (kernel_kind(name), kernel_kind(name, HTA_COMM_RE)) == (ours, htas), name
