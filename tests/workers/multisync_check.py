"""A step with two syncing backwards (accumulation without ``no_sync``: DDP all-reduces
after each), traced by the capture named on the command line; prints every bucket
all-reduce as ``[step, bucket, bytes, [param names]]`` (one process, gloo)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer import DDPTracer
from ddpscope.viz.run_files import read_rank_file

capture, port, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=0, world_size=1)
try:
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=0.5)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    with DDPTracer(ddp, opt, out_dir=out, capture=capture) as tracer:
        assert tracer.capture_note is None, tracer.capture_note
        for _ in range(4):
            for _ in range(2):
                ddp(torch.randn(8, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
    events = read_rank_file(out / "rank-0.json")[1]
    print(json.dumps(sorted([e["args"]["step"], e["args"]["bucket"], e["args"]["bytes"], e["args"]["params"]]
                            for e in events if e.get("cat") == "allreduce")))
finally:
    dist.destroy_process_group()
