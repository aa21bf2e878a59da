"""Test worker (run under torchrun by the tests): the tracer leaves nothing of its own
behind when it closes. Counts gloo's worker threads (named ``pt_gloo_runloop``) before
the tracer starts, while it traces, and after it closes; then exits at once, as a
script whose last line is the training loop does (a gloo group left alive to the
interpreter's end aborted such a rank now and then)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer import DDPTracer


def gloo_threads() -> int:
    n = 0
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            n += comm.read_text().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--capture", choices=("compiled", "python"), default="compiled")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    counts = {"before": gloo_threads()}
    with DDPTracer(ddp, opt, out_dir=Path(args.out) / "trace", capture=args.capture) as tracer:
        for _ in range(4):
            ddp(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        counts["tracing"] = gloo_threads()
    counts["after"] = gloo_threads()
    counts["capture_path"] = tracer._meta["capture_path"]
    (Path(args.out) / f"exit-rank{dist.get_rank()}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
