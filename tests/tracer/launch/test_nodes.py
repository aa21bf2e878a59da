"""Multi-node runs, for real: two "nodes" with their own network stacks (network
namespaces joined by a veth pair, gloo bound to each end), one ``--out`` shared by both;
and two nodes that each wrote their own folder, joined by ``ddpscope merge``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.tracer.launch.torchrun import free_port
from ddpscope.viz.trace import load_run
from tests.conftest import processes_mentioning, run_cli

pytestmark = pytest.mark.ddp

SUBNET = "10.231.77"  # addresses of this test's own two hosts, inside their namespaces only
DEMO = ["--nnodes", "2", "--nproc", "1", "--demo", "mlp", "--steps", "6", "--bucket-cap-mb", "1"]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces, ``(namespace, interface, address)`` each, joined by a veth
    pair; removed afterwards, also when the test fails. Skipped where this process may
    not make namespaces (no root / CAP_NET_ADMIN)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = f"{os.getpid() % 100000}"
    hosts = [(f"ddps{tag}n{k}", f"ddps{tag}v{k}", f"{SUBNET}.{k + 1}") for k in (0, 1)]
    made: list[str] = []
    try:
        for ns, _, _ in hosts:
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot make network namespaces here (needs root or CAP_NET_ADMIN): {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])]
        for ns, dev, addr in hosts:
            steps += [("link", "set", dev, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                      ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            assert r.returncode == 0, (step, r.stderr)
        yield hosts
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # takes its end of the veth pair, and so the pair, with it
        left = _ip("netns", "list").stdout
        assert not any(ns in left for ns in made), left
        assert not any(dev in _ip("link").stdout for _, dev, _ in hosts)


def _node(host: tuple[str, str, str], k: int, out: Path, endpoint: str, *extra: str, env: dict | None = None
          ) -> subprocess.Popen:
    ns, dev, _ = host
    pin = ["taskset", "-c", str(k)] if shutil.which("taskset") and (os.cpu_count() or 1) >= 2 else []
    cmd = ["ip", "netns", "exec", ns, *pin, sys.executable, "-m", "ddpscope.cli", "run", *DEMO, "--node-rank",
           str(k), "--rdzv-endpoint", endpoint, "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1", **(env or {})})


def _tx_bytes(ns: str, dev: str) -> int:
    stats = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", dev).stdout)
    return int(stats[0]["stats64"]["tx"]["bytes"])


@pytest.mark.lab
def test_two_nodes_over_their_own_link_share_one_folder(tmp_path, two_hosts):
    """Node 0 and node 1, each in its own namespace, run the same command into one
    ``--out`` (node 1's clock pushed 400 ms ahead). The job's trace is whole and
    ``complete``, with no warning; each node kept its records and logs apart; the clocks
    are aligned; the all-reduces really crossed the link; a folder of another job, or of
    a finished one, is refused."""
    out = tmp_path / "shared"
    endpoint = f"{two_hosts[0][2]}:29517"
    before = _tx_bytes(two_hosts[1][0], two_hosts[1][1])
    nodes = [_node(two_hosts[k], k, out, endpoint, env={"DDPSCOPE_TEST_CLOCK_SKEW_MS": "400"} if k else None)
             for k in (0, 1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    for stdout, stderr in outs:
        assert stdout.strip().splitlines()[-1] == str(out)
        assert "warning" not in stderr and "Traceback" not in stderr, stderr

    trace = load_run(out)
    assert trace.status == "complete", trace.unfinished
    assert trace.world_size == 2 and trace.steps.groupby("rank").size().to_dict() == {0: 6, 1: 6}
    records = {k: json.loads((out / "nodes" / f"node-{k}.json").read_text()) for k in (0, 1)}
    assert [records[k]["status"] for k in (0, 1)] == ["complete", "complete"]
    assert records[0]["job"] == records[1]["job"] == trace.run["job"] and records[1]["ranks"] == [1]
    assert all(list((out / "logs" / f"node-{k}").glob("*/attempt_0/0/stdout.log")) for k in (0, 1))

    # node 1's clock was 400 ms ahead: found, to within 5 ms
    assert abs(trace.ranks[1]["clock_offset"]["start"]["offset_us"] + 400_000) < 5_000
    # and the aligned times obey causality: an all-reduce completes on no rank before every
    # rank has launched it. This holds however loaded the machine is (a late observer only
    # makes done later), where the gap between the ranks' completions does not: beside
    # another CI lane it drew a 2.7 ms median. Unaligned, rank 0 would finish ~400 ms before
    # rank 1 launched.
    b = trace.buckets[trace.buckets.step >= 1].pivot_table(index=["step", "bucket"], columns="rank",
                                                           values=["launch_us", "done_us"])
    assert len(b) >= 5 * 10
    first_done = b["done_us"].min(axis=1)
    last_launch = b["launch_us"].max(axis=1)
    early = first_done - last_launch
    assert early.min() > -5_000, early.describe()
    diff = (b["done_us"][0] - b["done_us"][1]).abs()
    assert diff.median() < 10_000, diff.describe()

    # the gradients went over the veth pair: node 1 sent at least its half of every all-reduce
    grad_bytes = int(trace.buckets[trace.buckets["rank"] == 1].bytes.sum())
    assert _tx_bytes(two_hosts[1][0], two_hosts[1][1]) - before >= grad_bytes // 2

    # the same folder is refused to another job, and to this one again (it has run)
    other = run_cli("run", "--nnodes", "2", "--node-rank", "1", "--nproc", "1", "--rdzv-endpoint", endpoint,
                    "--demo", "gpt", "--out", str(out), timeout=60)
    assert other.returncode == 2 and "holds the trace of another job" in other.stderr
    again = run_cli("run", *DEMO, "--node-rank", "1", "--rdzv-endpoint", endpoint, "--out", str(out), timeout=60)
    assert again.returncode == 2 and "is not empty" in again.stderr
    assert processes_mentioning(str(out)) == []


def test_nodes_that_wrote_their_own_folders_are_merged_into_one_run(tmp_path):
    """Two nodes on this machine's loopback, each with its own ``--out`` (node 1's clock
    400 ms ahead): node 0 says where
    the other ranks are (no false "incomplete" warning); ``ddpscope merge`` makes one
    complete run of them, and refuses what is not one job's nodes, leaving nothing."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "ddpscope.cli", "run", *DEMO, "--node-rank", str(k),
                               "--rdzv-endpoint", endpoint, "--out", str(tmp_path / f"node{k}"), "-q"],
                              cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "DDPSCOPE_TEST_CLOCK_SKEW_MS": str(400 * k)})
             for k in (0, 1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "warning" not in outs[0][1] and "ddpscope merge" in outs[0][1], outs[0][1]
    assert not (tmp_path / "node1" / "run.json").exists()  # run.json is node 0's

    merged = tmp_path / "merged"
    proc = run_cli("merge", str(tmp_path / "node0"), str(tmp_path / "node1"), "--out", str(merged))
    assert proc.returncode == 0, proc.stderr
    trace = load_run(merged)
    assert trace.status == "complete", trace.unfinished
    assert trace.steps.groupby("rank").size().to_dict() == {0: 6, 1: 6}
    assert sorted(p.name for p in (merged / "nodes").iterdir()) == ["node-0.json", "node-1.json"]
    assert abs(trace.ranks[1]["clock_offset"]["start"]["offset_us"] + 400_000) < 5_000  # node 1's clock, aligned

    refused = {
        "one folder": [str(tmp_path / "node0")],
        "the same node twice": [str(tmp_path / "node0"), str(tmp_path / "node0"), str(tmp_path / "node1")],
        "not a node folder": [str(tmp_path / "node0"), str(merged.parent / "nothing")],
    }
    for why, folders in refused.items():
        bad = run_cli("merge", *folders, "--out", str(tmp_path / "never"), timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, (why, bad.stderr)
        assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never*")), why
    assert run_cli("merge", str(tmp_path / "node0"), str(tmp_path / "node1"), "--out", str(merged),
                   timeout=60).returncode == 2  # never over a run


def test_a_node_that_finds_the_folder_begun_by_another_waits_for_its_record(tmp_path, monkeypatch):
    """Nodes of one job start together: node 1 may look at --out between node 0 making
    it (its write probe, its logs) and announcing itself. It waits for that record instead
    of calling the folder someone else's; a folder that never gets one is refused."""
    import threading

    from ddpscope.tracer.launch import nodes

    out = tmp_path / "run"
    out.mkdir()
    (out / ".ddpscope-probe-1").write_bytes(b"")  # node 0, between create_out_dir and announce
    later = threading.Timer(0.5, nodes.announce, args=(out, "job1", 0, 2, 1))
    later.start()
    try:
        nodes.check_out_dir(out, "job1", node_rank=1)  # accepted once node 0's record is there
    finally:
        later.join()
    assert set(nodes.read_nodes(out)) == {0}
    monkeypatch.setattr(nodes, "JOIN_WAIT_S", 0.3)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        nodes.check_out_dir(other, "job1", node_rank=1)
