"""The compiled capture (``--capture compiled``): DDP's all-reduces timed by a C++
process group beside the reducer. Real 2-rank gloo jobs; the extension is built once
for the session (``ddpscope build``; ``.ci/run`` builds it first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.collective_timer import TORCH_CALLS
from ddpscope.tracer.capture.native import build as native
from ddpscope.viz.run_files import read_rank_file
from tests.conftest import ROOT, processes_mentioning, run_cli
from tests.tracer.capture.autotrace.test_autotrace import USER, _port, checks, trace_script, untraced

pytestmark = pytest.mark.ddp
WORKER = str(ROOT / "tests" / "workers" / "compiled_check.py")


@pytest.fixture(scope="module")
def built():
    result = native.ensure_built()
    if not result["ok"]:
        pytest.fail(f"the compiled capture does not build here: {result['error']}")
    return result


def _job(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                           "static", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--log-dir", str(tmp_path / "torchrun"),
                           WORKER, *args], cwd="/",
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_both_paths_time_the_same_allreduces_in_one_run(tmp_path, built):
    """The Python hook's all-reduces also go through the compiled wrapper: two instruments
    on the same collectives. Same count, sizes and order every step; the wrapper stamps
    launch after the hook (the hook's own Python runs first: 45-260 µs measured here) and
    completion before it (its C++ callback is registered first, and needs no GIL: 10-120
    µs earlier, or later by as long as the Python callback waits for the GIL). Launches are
    checked by order (between their hook's stamp and the next one's) and a median lag under
    1 ms; completion within 50 ms: bounds for a loaded 2-core machine."""
    _job(tmp_path, "--mode", "agree", "--out", str(tmp_path))
    lags: list[float] = []  # µs, the wrapper's launch after the hook's
    ready_lags: list[float] = []  # µs, the C++ gradient stamp after the Python hook's
    for r in (0, 1):
        compiled = json.loads((tmp_path / f"report-{r}.json").read_text())["compiled"]
        events = read_rank_file(tmp_path / "trace" / f"rank-{r}.json")[1]
        hooked = [e for e in events if e.get("cat") == "allreduce"]  # raw µs on this rank's clock
        assert len(compiled) == 6 and [len(s) for s in compiled] == [1, 3, 3, 3, 3, 3]  # DDP rebuilds after step 0
        for step, recs in enumerate(compiled):
            mine = sorted((e for e in hooked if e["args"]["step"] == step), key=lambda e: e["ts"])
            assert [b for _, _, b in recs] == [e["args"]["bytes"] for e in mine]
            # each launch between its own hook's stamp and the next bucket's (one thread
            # runs them in turn): an order no preemption on 2 loaded cores can upset
            nxt = [e["ts"] for e in mine[1:]] + [float("inf")]
            for (launch, done, _), e, after in zip(recs, mine, nxt):
                assert launch <= done
                assert e["ts"] <= launch <= after
                # the hook's completion callback needs the GIL, which the training thread may
                # hold for a while on 2 loaded cores (5.3 and 5.8 ms seen): the order is the check
                assert 0 <= e["ts"] + e["dur"] - done < 50_000
            lags.extend(launch - e["ts"] for (launch, _, _), e in zip(recs, mine))
        # gradient-ready times: the Python hook runs inside the accumulation, the C++ post
        # hook just after it: same parameters in the same order, C++ a little later
        ready = json.loads((tmp_path / f"report-{r}.json").read_text())["ready"]
        python = [e for e in events if e.get("cat") == "grad_ready"]
        for step, stamps in enumerate(ready):
            mine = sorted((e for e in python if e["args"]["step"] == step), key=lambda e: e["ts"])
            assert [p for p, _ in stamps] == [e["args"]["param"] for e in mine] and len(stamps) == 12
            nxt = [e["ts"] for e in mine[1:]] + [float("inf")]
            assert all(e["ts"] <= t <= after for (_, t), e, after in zip(stamps, mine, nxt))
            ready_lags.extend(t - e["ts"] for (_, t), e in zip(stamps, mine))
    # and close behind, not a constant offset away: medians (a stall now and then is allowed)
    assert sorted(lags)[len(lags) // 2] < 1000 and sorted(ready_lags)[len(ready_lags) // 2] < 1000


def test_a_compiled_run_of_a_users_script_matches_ddp_and_changes_nothing(tmp_path, built):
    proc, out, report = trace_script(tmp_path, USER, "--steps", "6", "--bucket-cap-mb", "1",
                                     ddpscope=("--capture", "compiled"))
    assert proc.returncode == 0, proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["capture_path"] == "compiled" and run["capture_path_note"] is None
    from ddpscope.viz.trace import load_run

    trace = load_run(out)
    for r in (0, 1):  # DDP's own bucket layout after its rebuild, from its runtime logging
        rebuilt = [[int(i) for i in b.split()] for b in checks(report)[r]["rebuilt"].split(",")]
        assert run["bucket_layout"] == rebuilt
        b = trace.buckets[(trace.buckets["rank"] == r) & (trace.buckets["step"] >= 1)]
        assert (b.groupby("step").size() == len(rebuilt)).all()
        assert (b["done_us"] >= b["launch_us"]).all() and not b["incomplete"].any()
        first = b[b["step"] == 1].sort_values("bucket")
        names = trace.ranks[r]["param_names"]
        assert [sorted(p) for p in first["params"]] == [sorted(names[i] for i in idx) for idx in rebuilt]
        # gradient-ready times (C++ hooks): every parameter once per step, and no bucket
        # launched before the last of its gradients was ready
        g = trace.grads[(trace.grads["rank"] == r) & (trace.grads["step"] >= 1)]
        assert (g.groupby("step").size() == len(names)).all()
        for (step, bucket), row in b.set_index(["step", "bucket"]).iterrows():
            ready = g[(g["step"] == step) & g["name"].isin(row["params"])]["ready_us"]
            assert len(ready) == len(row["params"]) and ready.max() <= row["launch_us"]
    plain = untraced(tmp_path, USER, "--steps", "6", "--bucket-cap-mb", "1")
    for r in (0, 1):
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


@pytest.mark.breadth  # ~18 s each; the unused map as its own row stays in the default suite (test_own_collectives)
@pytest.mark.parametrize("capture", ["compiled", "python"])
def test_ddps_unused_parameter_map_is_its_own_collective_never_a_bucket(tmp_path, built, capture):
    """``find_unused_parameters=True`` (Hugging Face Trainer's default): after its last
    bucket DDP all-reduces its map of locally used parameters (int32, one per parameter)
    on the reducer's group. That is no bucket: every step's buckets are DDP's own (their
    count and bytes are ``_get_ddp_logging_data()``'s ``bucket_sizes``), run.json's layout
    has no empty bucket, and the compiled capture, which sees every all-reduce on that
    group, keeps the map apart, on its own lane, 4 bytes per parameter, every step (the
    Python hook never sees it). Training is bit-identical to the untraced run."""
    script = (USER, "--steps", "5", "--find-unused", "--depth", "3", "--bucket-cap-mb", "0.25")
    proc, out, report = trace_script(tmp_path, *script, ddpscope=("--capture", capture))
    assert proc.returncode == 0, proc.stderr
    from ddpscope.viz.trace import load_run

    trace, ddp = load_run(out), checks(report)
    assert trace.run["capture_path"] == capture and trace.run["find_unused_parameters"] is True
    layout = trace.run["bucket_layout"]
    assert len(layout) == len(ddp[0]["bucket_sizes"]) >= 2 and all(layout)
    for r in (0, 1):
        b = trace.buckets[trace.buckets["rank"] == r]
        assert b["step"].nunique() == 5
        for _, one in b.groupby("step"):
            assert sorted(one["bytes"]) == sorted(ddp[r]["bucket_sizes"])
        steps = trace.steps[trace.steps["rank"] == r]
        assert (steps["num_buckets"] == len(layout)).all()
        if capture == "compiled":
            assert (steps["ddp_own_bytes"] == 4 * len(trace.run["param_bytes"])).all()
            assert (steps["ddp_own_end_us"] >= steps["ddp_own_start_us"]).all()
            assert (steps["ddp_own_start_us"] >= steps.merge(b.groupby("step")["launch_us"].max().rename("last"),
                                                               left_on="step", right_index=True)["last"]).all()
        else:
            assert steps["ddp_own_bytes"].isna().all()
    events = read_rank_file(out / "rank-0.json")[1]
    own = [e for e in events if e.get("cat") == "ddp_collective"]
    assert [e["name"] for e in own] == (["unused-parameter map"] * 5 if capture == "compiled" else [])
    from ddpscope.viz.ddp.gantt import make_timeline_figure

    lanes = {t.name for t in make_timeline_figure(trace).data}
    assert ("DDP's unused-parameter map" in lanes) == (capture == "compiled") and "bucket all-reduce" in lanes
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert ddp[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


def test_the_scripts_own_hook_is_timed_in_python_and_said(tmp_path, built):
    proc, out, report = trace_script(tmp_path, USER, "--hook", "fp16", "--steps", "5", "--bucket-cap-mb", "1",
                                     ddpscope=("--capture", "compiled"))
    assert proc.returncode == 0, proc.stderr
    meta, events = read_rank_file(out / "rank-0.json")
    assert meta["capture_path"] == "python" and "communication hook" in meta["capture_path_note"]
    assert len([e for e in events if e.get("cat") == "allreduce" and e["args"]["step"] >= 1]) >= 4
    plain = untraced(tmp_path, USER, "--hook", "fp16", "--steps", "5", "--bucket-cap-mb", "1")
    for r in (0, 1):
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


@pytest.mark.breadth  # two models traced: test_session.py's GAN
def test_two_models_then_detached_run_on_untraced_and_bit_identical(tmp_path, built):
    _job(tmp_path, "--mode", "detach", "--out", str(tmp_path / "traced"))
    _job(tmp_path, "--mode", "detach", "--untraced", "--out", str(tmp_path / "plain"))
    for r in (0, 1):
        traced = json.loads((tmp_path / "traced" / f"report-{r}.json").read_text())
        plain = json.loads((tmp_path / "plain" / f"report-{r}.json").read_text())
        assert traced["wrappers"] == {"a": True, "b": True}
        assert traced["attached_after_exit"] == {"a": False, "b": False}
        assert traced["records_after_exit"] == {"a": 0, "b": 0}  # the reducers' own groups again
        assert traced["sha"] == plain["sha"]
    from ddpscope.viz.trace import load_run

    ddp_says = json.loads((tmp_path / "traced" / "report-0.json").read_text())["buckets"]
    for k in ("a", "b"):  # each model's own all-reduces, one record per bucket of its own, every step
        t = load_run(tmp_path / "traced" / k)
        per_step = t.buckets[t.buckets["step"] >= 1].groupby(["rank", "step"]).size()
        assert len(per_step) == 2 * 5 and set(per_step) == {ddp_says[k]}


def test_without_a_compiler_the_python_hook_times_the_run_and_says_so(tmp_path):
    """An empty cache and CXX naming no compiler: the build fails in one line, the run
    goes on with the Python hook, run.json says which path ran and why."""
    env = {"DDPSCOPE_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-compiler")}
    out, report = tmp_path / "run", tmp_path / "report"
    proc = run_cli("run", "--nproc", "2", "--capture", "compiled", "--out", str(out), "--", USER, "--steps", "4",
                   "--report", str(report), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    said = [l for l in proc.stderr.splitlines() if "compiled capture" in l]
    assert any("could not be built" in l for l in said) and "Traceback" not in proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["capture_path"] == "python" and "could not be built" in run["capture_path_note"]
    events = read_rank_file(out / "rank-1.json")[1]
    assert any(e.get("cat") == "allreduce" for e in events)
    assert processes_mentioning(str(out)) == []


def test_device_times_wait_per_take_oldest_first_until_their_step_is_resolved():
    """On a device the wrapper keeps each take's device times until its step is resolved
    (several steps may wait: the host runs ahead of the device), and reads them oldest
    first. Plain bookkeeping: no GPU needed, nothing faked (the stand-in device's test runs
    it for real: tests/tracer/capture/test_device_path.py)."""
    from ddpscope.tracer.capture.ddp.compiled import DeviceLag
    from ddpscope.tracer.capture.ddp.records import BucketRecord

    lag = DeviceLag()
    step3, step4, step5 = object(), object(), object()
    b3 = [BucketRecord(index=k, nbytes=8, params=(k,), launch=None) for k in range(2)]
    b4 = [BucketRecord(index=0, nbytes=8, params=(0,), launch=None)]
    b4_second_pass = [BucketRecord(index=0, nbytes=8, params=(0,), launch=None)]
    lag.hand_over(step3, b3)
    lag.hand_over(step4, b4)
    lag.hand_over(step4, b4_second_pass)  # two syncing passes in one step: two takes
    # resolving step 4 reads step 3's take first (the wrapper reads in order), then both of its own
    assert lag.through([step4]) == 3 and lag.through([step3]) == 1 and lag.through([step5]) == 0
    lag.fill_oldest([])  # nothing read (no device times): still waiting
    assert lag.through([step3]) == 1
    lag.fill_oldest([(2_000_000, 2_500_000, 400_000), (2_100_000, 0, 0)])  # ns; 0: its completion never came
    assert [(b.launch, b.done, b.kernel_us) for b in b3] == [(2000.0, 2500.0, 400.0), (2100.0, None, None)]
    assert lag.through([step3]) == 0 and lag.through([step4]) == 2
    lag.fill_oldest([(3_000_000, 3_200_000, 0)])  # the backend did not time it: no kernel time
    assert (b4[0].launch, b4[0].done, b4[0].kernel_us) == (3000.0, 3200.0, None) and b4_second_pass[0].launch is None
    assert lag.through([step4]) == 1


def test_device_ready_times_reach_their_step_when_it_is_resolved_and_not_before():
    """On a device the C++ ready hooks record an event per gradient (a ring slot): the step
    gets its gradients at the end of each backward with no time yet, and their times when
    the recorder resolves that step (its end event done), in order; a slot the ring had no
    room for (-1, read back as 0) stays without a time. The C++ ring cannot run without a
    GPU: ``ready`` is a stand-in for it (the one here, said so); test_cuda.py runs the real one."""
    from types import SimpleNamespace

    from ddpscope.tracer.capture.ddp.compiled import CompiledBuckets, DeviceLag

    class Ring:  # stand-in for ext.ReadyTimes on a device group: slot s resolves to 1000 * (s + 1) ns
        on_device = True

        def __init__(self):
            self.stamped, self.resolved = [], []

        def take_device(self, k):
            out, self.stamped = [(p, s, k) for p, s in self.stamped], []
            return out

        def resolve(self, slots, skew_ns, known_done=False):
            self.resolved.append(list(slots))
            return [0 if s < 0 else 1000 * (s + 1) + skew_ns for s in slots]

    cb = object.__new__(CompiledBuckets)  # the bookkeeping alone: no group, no DDP
    cb.ready, cb._ready_slots, cb.group, cb.lag, cb.skew_ns = Ring(), [], None, DeviceLag(), 0
    step3, step4 = SimpleNamespace(grads=[]), SimpleNamespace(grads=[])
    cb.ready.stamped = [(2, 0), (1, 1)]
    cb.take_ready(step3, 0)
    cb.ready.stamped = [(0, 2)]
    cb.take_ready(step3, 1)  # a second backward of the step (gradient accumulation)
    cb.ready.stamped = [(2, 3), (1, -1)]
    cb.take_ready(step4, 0)
    assert step3.grads == [(2, None, 0), (1, None, 0), (0, None, 1)]  # no time before it is resolved
    cb.settle([step3])
    assert step3.grads == [(2, 1.0, 0), (1, 2.0, 0), (0, 3.0, 1)]  # µs
    assert step4.grads == [(2, None, 0), (1, None, 0)] and cb.ready.resolved == [[0, 1], [2]]
    cb.settle([step4])
    assert step4.grads == [(2, 4.0, 0), (1, None, 0)] and cb._ready_slots == []


def test_a_second_build_waits_on_the_lock_and_finds_the_first_ones_build(tmp_path, built):
    """Ranks of several jobs (or nodes sharing a cache) never compile side by side: a
    builder holding the lock makes the next one wait, which then takes the finished build.
    Real processes and a real flock; the first build is played by this test (no compile)."""
    import fcntl
    import shutil
    import time

    env = {**os.environ, "DDPSCOPE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    folder = Path(subprocess.run([sys.executable, "-c", "from ddpscope.tracer.capture.native import build; print(build.build_dir())"],
                                 env=env, capture_output=True, text=True, check=True).stdout.strip())
    folder.mkdir(parents=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first builder, mid-build
        second = subprocess.Popen([sys.executable, "-m", "ddpscope.tracer.capture.native.build"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)
        assert second.poll() is None, second.communicate()  # waiting on the lock, not compiling
        lib = Path(built["library"])
        shutil.copy(lib, folder / lib.name)  # the first builder's result, then its stamp
        (folder / native.STAMP).write_text(json.dumps({"library": lib.name}))
    out, err = second.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] and result["built"] is False and Path(result["library"]) == folder / lib.name, err


def test_the_gradients_bytes_counted_in_cxx_equal_pythons(built):
    """The memory accounting's C++ count of the gradients (each region once) against
    ``distinct_bytes``, on real gradients: own tensors, views into one flat buffer (as
    ``gradient_as_bucket_view`` makes them), one tensor shared by two parameters, none;
    a sparse gradient is left to Python (-1)."""
    import torch

    from ddpscope.tracer.capture.memory import distinct_bytes

    ext = native.load_built()
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    params = list(model.parameters())
    count = ext.GradBytes(params)
    assert count() == 0  # no gradients yet
    model(torch.randn(3, 16)).sum().backward()
    grads = [p.grad for p in params]
    assert count() == distinct_bytes(grads) == sum(p.numel() * 4 for p in params)
    flat = torch.zeros(sum(p.numel() for p in params))
    at = 0
    for p in params:
        p.grad = flat[at: at + p.numel()].view_as(p)
        at += p.numel()
    assert count() == distinct_bytes(p.grad for p in params) == flat.nbytes
    params[1].grad = params[3].grad = torch.ones(8)  # one tensor for both biases: counted once
    params[0].grad = None
    views = sum(params[k].numel() * 4 for k in (2, 4, 5))
    assert count() == distinct_bytes(p.grad for p in params) == 8 * 4 + views
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert ext.GradBytes(list(emb.parameters()))() == -1


def test_two_syncing_backwards_in_a_step_are_attributed_as_the_python_hook_does(tmp_path, built):
    """Gradient accumulation without ``no_sync``: DDP all-reduces after each backward.
    The compiled capture takes a pass's all-reduces when the next backward starts (or the
    step closes): the same buckets, bytes and parameters per step as the Python hook sees,
    DDP's pre-rebuild bucket in the first pass of step 0 included."""
    worker = str(ROOT / "tests" / "workers" / "multisync_check.py")
    seen = {}
    for capture in ("compiled", "python"):
        proc = subprocess.run([sys.executable, worker, capture, str(_port()), str(tmp_path / capture)], cwd="/",
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen[capture] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["compiled"] == seen["python"]
    steps = {}
    for step, _, _, _ in seen["compiled"]:
        steps[step] = steps.get(step, 0) + 1
    assert steps == {0: 4, 1: 6, 2: 6, 3: 6}  # step 0: one bucket before DDP's rebuild, then 3; then 3 + 3


@pytest.mark.parametrize("capture, pattern", [("compiled", "--join"),
                                              pytest.param("python", "--join", marks=pytest.mark.breadth),
                                              pytest.param("compiled", "--loss-allreduce", marks=pytest.mark.breadth)])
def test_joins_flag_and_a_scripts_own_all_reduces_are_never_buckets(tmp_path, built, capture, pattern):
    """Uneven inputs under ``Join([ddp])`` (DDP all-reduces a gradient-sync flag in every
    forward; the rank out of data shadows the others' buckets until all are done) and a
    script that averages its loss for logging (an all_reduce between backward and step):
    neither is a bucket: each is a collective of its step's own, named. Every step's buckets are the layout DDP rebuilt
    (``rebuilt_per_bucket_param_indices``), byte for byte; the rank with fewer inputs has
    fewer steps; training is bit-identical to the untraced run. (Both go to DDP's own
    ``process_group``, which the compiled capture leaves alone: it wraps the reducer's.)"""
    script = (USER, "--steps", "5", pattern, "--depth", "3", "--bucket-cap-mb", "0.25")
    proc, out, report = trace_script(tmp_path, *script, ddpscope=("--capture", capture))
    assert proc.returncode == 0, proc.stderr
    from ddpscope.viz.trace import load_run

    trace, ddp = load_run(out), checks(report)
    assert trace.run["capture_path"] == capture and trace.status == "complete"
    rebuilt = [[int(i) for i in b.split()] for b in ddp[0]["rebuilt"].split(",")]
    assert trace.run["bucket_layout"] == rebuilt and len(rebuilt) >= 2
    sizes = sorted(sum(trace.run["param_bytes"][i] for i in b) for b in rebuilt)
    for r in (0, 1):
        b = trace.buckets[(trace.buckets["rank"] == r) & (trace.buckets["step"] >= 1)]
        assert b["step"].nunique() == ddp[r]["steps"] - 1
        for _, one in b.groupby("step"):
            assert sorted(one["bytes"]) == sizes
        steps = trace.steps[trace.steps["rank"] == r]
        assert steps["ddp_own_bytes"].isna().all()
        # recorded as what they are: under Join each forward notifies the join context and
        # all-reduces DDP's gradient-sync flag (torch.ones(1): 4 bytes each, two a step);
        # the script's loss is 4 bytes after backward, one a step
        _, events = read_rank_file(out / fmt.rank_file(r))
        names = {e["name"] for e in events if e.get("cat") == fmt.CAT_DDP_OWN}
        joins = {TORCH_CALLS[("torch.nn.parallel.distributed", "_check_global_requires_backward_grad_sync")],
                 TORCH_CALLS[("torch.distributed.algorithms.join", "notify_join_context")]}
        assert names == (joins if pattern == "--join" else
                         {n for n in names if n.startswith("all_reduce (the script, user_train.py:")}) and names
        per_step = 2 if pattern == "--join" else 1
        assert steps["other_comm_count"].tolist() == [per_step] * ddp[r]["steps"]
        assert steps["other_comm_bytes"].tolist() == [4 * per_step] * ddp[r]["steps"]
    assert [ddp[r]["steps"] for r in (0, 1)] == ([5, 4] if pattern == "--join" else [5, 5])
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]
        assert checks(report)[r]["losses"] == checks(plain)[r]["losses"]


@pytest.mark.breadth  # both captures (~15 s each): a real job of DDP's buffer broadcast
@pytest.mark.parametrize("capture", ["compiled", "python"])
def test_ddps_buffer_broadcast_is_its_own_collective_on_its_own_lane(tmp_path, built, capture):
    """BatchNorm's running statistics: before each syncing forward DDP broadcasts the
    module's buffers from rank 0 (``broadcast_buffers=True``, its default). Recorded as
    DDP's own collective, every step, its bytes the module's buffers' (the script's own
    count), on a lane of its own; the buckets stay DDP's; training is bit-identical."""
    script = (USER, "--steps", "4", "--batchnorm", "--depth", "3", "--bucket-cap-mb", "0.25")
    proc, out, report = trace_script(tmp_path, *script, ddpscope=("--capture", capture))
    assert proc.returncode == 0, proc.stderr
    from ddpscope.viz.ddp.gantt import make_timeline_figure
    from ddpscope.viz.trace import load_run

    trace, ddp = load_run(out), checks(report)
    assert trace.run["capture_path"] == capture
    layout = trace.run["bucket_layout"]
    for r in (0, 1):
        steps = trace.steps[trace.steps["rank"] == r]
        assert (steps["buffer_sync_bytes"] == ddp[r]["buffer_bytes"]).all() and ddp[r]["buffer_bytes"] > 0
        assert (steps["buffer_sync_end_us"] >= steps["buffer_sync_start_us"]).all()
        # inside the forward, before the model's own compute
        assert (steps["buffer_sync_start_us"] >= steps["forward_start_us"]).all()
        assert (steps["buffer_sync_end_us"] <= steps["forward_end_us"]).all()
        assert (steps[steps["step"] >= 1]["num_buckets"] == len(layout)).all()
    events = read_rank_file(out / "rank-0.json")[1]
    assert [e["name"] for e in events if e.get("cat") == "ddp_collective"] == ["buffer broadcast"] * 4
    assert "DDP's buffer broadcast" in {t.name for t in make_timeline_figure(trace).data}
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert ddp[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


BACKENDS = """
import torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers torch's own "fake" backend
from ddpscope.tracer.capture.native import build as native
dist.init_process_group("cpu:gloo,cuda:fake", store=dist.HashStore(), rank=0, world_size=1)
wrapped = native.load_built().wrap(dist.group.WORLD, 16, None)
print(*(f"{d}={g._get_backend(torch.device(d)).name()}" for g in (dist.group.WORLD, wrapped) for d in ("cpu", "cuda")))
"""


def test_each_device_type_keeps_its_own_backend_behind_the_wrapper(built):
    """A group of two backends ("cpu:gloo,cuda:nccl" is what init_process_group() gives on a
    GPU machine; here CUDA's is torch's fake backend, as this machine has no NCCL): behind
    the wrapper each device type still reaches its own backend. Registered under the
    group's one default type, both reached whichever was registered first."""
    proc = subprocess.run([sys.executable, "-c", BACKENDS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cpu=gloo", "cuda=fake"] * 2


LAYOUTS = """
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddpscope.tracer.capture.ddp.compiled import assigned_layout, rebuilt_layout
from ddpscope.tracer.capture.ddp.reducer import reducer_params
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), *[torch.nn.Linear(256, 256) for _ in range(5)])
ddp = DDP(model, bucket_cap_mb=float(sys.argv[1]), static_graph=sys.argv[2] == "static")
names, params = reducer_params(ddp)
index = {id(p): i for i, p in enumerate(params)}
def copied():  # the reducer's buckets as copies (what a device must not do)
    buckets = sorted(ddp.reducer._get_zeros_like_grad_buckets(), key=lambda b: b.index())
    return [[index[id(p)] for p in b.parameters()] for b in buckets], [b.buffer().nbytes for b in buckets]
first = assigned_layout(ddp, params)
out = {"first": [list(map(list, first[0])), list(first[1])] if first else None, "first_copied": copied()}
for _ in range(3):
    ddp(torch.randn(8, 64)).sum().backward()
layout, sizes = copied()
out["rebuilt_copied"] = [layout, sizes]
rebuilt = rebuilt_layout(ddp, tuple(sizes))
out["rebuilt"] = list(map(list, rebuilt)) if rebuilt is not None else None
out["other_sizes"] = rebuilt_layout(ddp, tuple(sizes[:-1]))
if dist.get_rank() == 0:
    print(json.dumps(out))
# The reducer holds the group: drop it before destroying the group, or gloo's threads may be torn
# down at interpreter exit (a rare "terminate called without an active exception", seen in CI twice,
# the second time after this drop): the script's result is printed, so it leaves without Python's
# teardown of gloo's threads.
dist.barrier()
del ddp
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.parametrize("graph", ["dynamic", pytest.param("static", marks=pytest.mark.breadth)])
def test_a_device_reads_ddps_bucket_layout_without_copying_the_buckets(tmp_path, graph):
    """On a device the compiled capture never copies every bucket (a copy of every gradient on
    the GPU): the first layout is assigned as DDP assigned it, the rebuilt one read from DDP's
    logging data. Both equal the reducer's own buckets (read here by copying them, on CPU)."""
    script = tmp_path / "layouts.py"
    script.write_text(LAYOUTS)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                           "static", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--log-dir", str(tmp_path / "torchrun"),
                           str(script), "0.3", graph],
                          capture_output=True, text=True, timeout=180, cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == out["first_copied"]
    if graph == "dynamic":  # DDP rebuilt its buckets from the first iteration's ready order
        assert len(out["rebuilt_copied"][0]) > len(out["first_copied"][0]) == 1
        assert out["rebuilt"] == out["rebuilt_copied"][0]
    assert out["other_sizes"] is None  # another step's all-reduces: not this layout
