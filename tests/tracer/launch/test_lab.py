"""Emulated nodes (tracer/launch/lab.py, tracer/launch/emulated.py), for real: network
namespaces joined through links shaped by tc's token bucket, a DDP job across them, and
what is left when the run ends, fails, is interrupted or its launcher is killed.
Skipped, saying why, where this process may not make namespaces (no root or
CAP_NET_ADMIN); CI here runs as root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ddpscope.tracer.launch.emulated import node_argv
from ddpscope.tracer.launch.lab import Lab, burst_bytes, lab_leftovers, parse_rate, sweep_stale, why_not
from ddpscope.viz.ring.cost import compute_ring_fit, fit_ring_cost, link_GBps
from ddpscope.viz.ring.metrics import compute_ring_summary
from ddpscope.viz.ring.trace import load_ring
from ddpscope.viz.trace import load_run
from ddpscope.viz.whatif.cost import read_calibration
from tests.conftest import processes_mentioning, run_cli

_no_lab = pytest.mark.skipif(why_not() is not None, reason=f"no lab here: {why_not()}")


def needs_lab(test):
    """A test that builds a lab: marked ``lab`` (``.ci/run`` runs them after the default
    suite, with ``-m lab``), skipped, saying why, where no lab can be made."""
    return pytest.mark.lab(_no_lab(test))
DEMO = ["--nproc", "1", "--demo", "mlp"]


@pytest.fixture(autouse=True)
def nothing_left():
    """Every test leaves no namespace and no link of a lab behind, also when it fails."""
    yield
    if why_not() is None:
        left = [x for x in lab_leftovers() if f"-{os.getpid()}-" in x or x.startswith(f"dsl{os.getpid()}")]
        for name in left:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        assert not left, left


def test_link_rates_are_read_in_tcs_units_and_bad_ones_are_named():
    assert parse_rate("1gbit") == 1e9 and parse_rate("100mbit") == 1e8 and parse_rate("2.5GBIT") == 2.5e9
    for bad in ("fast", "1gb", "0mbit", "500kbit", "1000gbit", ""):
        with pytest.raises(ValueError, match="must be"):
            parse_rate(bad)


def test_a_nodes_command_is_the_jobs_own_as_one_node_of_several(tmp_path, monkeypatch):
    """The lab's flags go, the node's come first, --out is this folder's (a node runs in
    the script's folder), and nothing after -- is touched: it is the script's."""
    monkeypatch.chdir(tmp_path)
    argv = node_argv(["ddpscope", "run", "--nproc", "1", "--emulate-nodes", "2", "--link", "1gbit", "--out", "runs/x",
                      "--", "train.py", "--link", "1", "--out", "y"], 1, 2, "10.97.0.1:29500")
    assert argv == [sys.executable, "-m", "ddpscope.cli", "run", "--nnodes", "2", "--node-rank", "1",
                    "--rdzv-endpoint", "10.97.0.1:29500", "--nproc", "1", "--out", str(tmp_path / "runs" / "x"),
                    "--", "train.py", "--link", "1", "--out", "y"]
    assert node_argv(["ddpscope", "calibrate", "--max-mb", "1", "--emulate-nodes", "2", "--link", "1gbit", "--",
                      "/r"], 0, 2, "h:1")[3:] == ["calibrate", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                                                  "h:1", "--max-mb", "1", "--", "/r"]
    with pytest.raises(ValueError, match="not a ddpscope command line"):
        node_argv(["torchrun", "x"], 0, 2, "h:1")


@needs_lab
@pytest.mark.parametrize("rate", ["100mbit", "400mbit"])
def test_a_link_carries_its_shaped_rate(rate):
    """A TCP stream from node 1 to node 0 through the switch: within 20 % of the rate."""
    with Lab(2, rate) as lab:
        n0, n1 = lab.nodes
        seconds = 1.0
        nbytes = int(parse_rate(rate) / 8 * seconds)
        server = subprocess.Popen([*n0.prefix(), sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
        try:
            _wait_listening(n0)
            subprocess.run([*n1.prefix(), sys.executable, "-c", _CLIENT, n0.address, str(nbytes)], check=True,
                           timeout=60)
            got, bps = json.loads(server.communicate(timeout=60)[0])
        finally:
            server.kill()
            server.wait()
    assert got == nbytes
    assert abs(bps / parse_rate(rate) - 1) < 0.2, f"{bps / 1e6:.0f} Mbit/s over a {rate} link"


_SERVER = """
import json, socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5001)); s.listen(1)
c, _ = s.accept(); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(json.dumps([n, n * 8 / (time.perf_counter() - t0)]))
"""
_CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5001)); left = int(sys.argv[2])
while left > 0:
    k = min(left, 1 << 20); s.sendall(b"x" * k); left -= k
s.close()
"""


def _wait_listening(node) -> None:
    for _ in range(100):
        r = subprocess.run([*node.prefix(), "ss", "-ltn"], capture_output=True, text=True)
        if ":5001" in r.stdout:
            return
        time.sleep(0.05)


@needs_lab
@pytest.mark.ddp
def test_two_emulated_nodes_give_one_complete_multi_node_trace_and_leave_nothing(tmp_path):
    out = tmp_path / "lab"
    proc = run_cli("run", "--emulate-nodes", "2", "--link", "200mbit", *DEMO, "--steps", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 emulated nodes of 1 ranks, each over a 200mbit link" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    trace = load_run(out)
    assert trace.status == "complete" and trace.world_size == 2, trace.unfinished
    assert trace.steps.groupby("rank").size().to_dict() == {0: 4, 1: 4}
    assert {json.loads((out / "nodes" / f"node-{k}.json").read_text())["status"] for k in (0, 1)} == {"complete"}
    run = trace.run
    assert run["emulation"]["nodes"] == 2 and run["emulation"]["link_bps"] == 2e8
    assert run["command"].startswith("ddpscope run --nproc 1 --steps 4 --emulate-nodes 2 --link 200mbit --out ")
    assert {trace.ranks[r]["host"] for r in (0, 1)} == {trace.ranks[0]["host"]}  # one machine: the same name
    # the link bounds the all-reduces: 2 ranks send each bucket's bytes once across it
    b = trace.buckets[trace.buckets.step >= 1]
    gbps = (b["bytes"] * 8 / ((b["done_us"] - b["launch_us"]) * 1e-6)).max()
    assert gbps < 2e8 * 1.2
    assert not lab_leftovers()

    # its calibration runs in a lab like its own: the same nodes, ranks and link
    before = (out / "run.json").read_bytes()
    proc = run_cli("calibrate", str(out), "--max-mb", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out / "calibration.json")
    cal = read_calibration(out)
    assert cal.world_size == 2 and cal.meta["nnodes"] == 2 and cal.meta["emulation"] == run["emulation"]
    assert cal.unlike(run, 2) is None and (out / "run.json").read_bytes() == before
    assert sorted((out / "logs" / "calibrate").iterdir()) == [out / "logs" / "calibrate" / f"node-{k}" for k in (0, 1)]
    # its largest all-reduce crossed the link: no faster than the link's rate allows (less one burst)
    largest, us = cal.sizes[-1], cal.us[-1]
    assert largest == 2**20 and us * 1e-6 >= 0.9 * (largest - burst_bytes(2e8)) * 8 / 2e8, us
    proc = run_cli("whatif", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    notes = " ".join(json.loads(proc.stdout)["model_notes"])
    assert "cost from calibration" in notes and "not used" not in notes
    assert not lab_leftovers()


@needs_lab
@pytest.mark.ddp
def test_a_ring_across_emulated_nodes_is_bound_by_the_link_and_fits_alpha_beta(tmp_path):
    out = tmp_path / "ring"
    proc = run_cli("ring", "--emulate-nodes", "2", "--link", "200mbit", "--nproc", "1", "--mb", "2",
                   "--repeat", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out) and "round 3/3" in proc.stderr
    ring = load_ring(out)
    assert ring.world_size == 2 and ring.run["status"] == "complete" and ring.run["nnodes"] == 2
    assert ring.run["command"].startswith("ddpscope ring --nproc 1 --mb 2 --repeat 3 --dtype float32 "
                                          "--emulate-nodes 2 --link 200mbit")
    assert link_GBps(ring) == 2e8 / 8e9
    # PyTorch's all-reduce of the tensor runs at the link's rate (2 ranks: busbw = bytes / time): never
    # above it (+20 %: tc's burst), and near it from below; gloo's copies through the veth pair take the
    # CPU, which CI shares with a lane of its own (78 % of the rate read there once, beside lane A)
    summary = compute_ring_summary(ring).set_index("bytes")
    assert 0.6 < summary.loc[ring.size_bytes, "ref_busbw_GBps"] / link_GBps(ring) < 1.2, summary
    # every step of the ring sends its chunk across the link: no faster than its rate (less one burst)
    main = ring.steps[ring.steps["round"].isin(ring.main_rounds())]
    floor_us = (main["send_bytes"] - burst_bytes(2e8)) * 8 / 2e8 * 1e6
    assert len(main) == 2 * 2 * 3 and (main["comm_us"] >= 0.9 * floor_us).all(), main[["comm_us", "send_bytes"]]
    # the alpha-beta model fitted to its sizes: no faster than the link, and through the tensor's time
    model = fit_ring_cost(ring)
    assert model.sizes == 3 and model.bandwidth_GBps <= 1.2 * link_GBps(ring)
    fit = compute_ring_fit(ring, model).set_index("bytes")
    assert abs(fit.loc[ring.size_bytes, "error_pct"]) < 10, fit
    assert not lab_leftovers()


@needs_lab
@pytest.mark.ddp
def test_ctrl_c_stops_every_node_and_removes_the_lab(tmp_path):
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "ddpscope.cli", "run", "--emulate-nodes", "2", "--link",
                             "100mbit", *DEMO, "--steps", "500", "--out", str(out)], cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_step(out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "partial trace kept in" in err
    assert not processes_mentioning(str(out)) and not lab_leftovers()


@needs_lab
@pytest.mark.ddp
def test_a_killed_launcher_stops_its_nodes_and_the_next_lab_removes_what_it_left(tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "ddpscope.cli", "run", "--emulate-nodes", "2", "--link",
                             "100mbit", *DEMO, "--steps", "500", "--out", str(out)], cwd="/",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_step(out)
    proc.kill()  # SIGKILL: no cleanup of its own
    proc.wait()
    left = [x for x in lab_leftovers() if f"-{proc.pid}-" in x]
    assert len(left) == 3, left  # node0, node1 and the switch stay...
    deadline = time.monotonic() + 90
    while processes_mentioning(str(out)) and time.monotonic() < deadline:  # ...its nodes stop (SIGTERM on its death)
        time.sleep(0.5)
    assert not processes_mentioning(str(out))
    # each node's launcher stopped its job the ordinary way, and said so (none died mid-write)
    assert {json.loads((out / "nodes" / f"node-{k}.json").read_text())["status"] for k in (0, 1)} == {"failed"}
    assert set(sweep_stale()) >= set(left)  # what a later run does first
    assert not [x for x in lab_leftovers() if f"-{proc.pid}-" in x]


@pytest.mark.skipif(shutil.which("capsh") is None, reason="needs capsh (libcap2-bin) to drop CAP_NET_ADMIN")
def test_without_cap_net_admin_it_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "never"
    cmd = f"{sys.executable} -m ddpscope.cli run --emulate-nodes 2 --nproc 1 --demo mlp --out {out}"
    proc = subprocess.run(["capsh", "--drop=cap_net_admin", "--", "-c", cmd], capture_output=True, text=True,
                          timeout=120, cwd="/", env=os.environ)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "--emulate-nodes: emulated nodes need root or CAP_NET_ADMIN" in proc.stderr and not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--link", "1gbit"], "--link goes with --emulate-nodes N"),
    (["--emulate-nodes", "1"], "--emulate-nodes must be in 2..64"),
    (["--emulate-nodes", "2", "--link", "fast"], "--link must be a rate such as 100mbit"),
    (["--emulate-nodes", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "--emulate-nodes runs every node here"),
])
def test_bad_lab_settings_are_one_line_and_exit_2(tmp_path, args, message):
    out = tmp_path / "never"
    proc = run_cli("run", *DEMO, *args, "--out", str(out))
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not out.exists()


def _wait_for_step(out) -> None:
    """Until the run's rank 0 has finished a traced step (its summary holds a row)."""
    deadline = time.monotonic() + 120
    summary = out / "rank-0.summary.jsonl"
    while time.monotonic() < deadline:
        if summary.exists() and summary.read_text().count('"step"') >= 2:
            return
        time.sleep(0.2)
    raise AssertionError("the run never made a step")
