"""Real DDP (gloo, two ranks: with one, DDP keeps a single bucket) per cap: the order
gradients became ready in the first backward (post-accumulate-grad hooks, as the tracer
sees it) and the layout DDP rebuilt, from its own runtime logging (written at the
forward after the rebuild). Rank 0 prints one JSON line per cap.

    torchrun --nproc-per-node 2 tests/workers/layout_check.py CAP[,CAP...]
        ("default": no bucket_cap_mb; "0.25/1/4": bucket_cap_mb_list=[0.25, 1, 4])
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from ddpscope.tracer.workloads.demo.models import build_model  # noqa: E402


class Mixed(nn.Module):
    """The demo GPT plus a float64 head: DDP buckets each dtype apart."""

    def __init__(self):
        super().__init__()
        self.gpt = build_model("gpt")
        self.head = nn.Linear(64, 300).double()

    def forward(self, x):
        return self.gpt(x).mean() + self.head(torch.ones(3, 64, dtype=torch.float64)).sum().float()


def main() -> None:
    caps = sys.argv[1].split(",")
    dist.init_process_group("gloo")
    for cap in caps:
        torch.manual_seed(0)
        model = Mixed()
        kw = {} if cap == "default" else {"bucket_cap_mb_list": [float(c) for c in cap.split("/")]} if "/" in cap \
            else {"bucket_cap_mb": float(cap)}
        ddp = DDP(model, **kw)
        params = [p for p in ddp.parameters() if p.requires_grad]
        order = []
        hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i)) for i, p in enumerate(params)]
        for step in range(3):
            x, _ = model.gpt.batch(torch.Generator().manual_seed(step))
            ddp(x).backward()
            if step == 0:
                first = list(order)
        for h in hooks:
            h.remove()
        data = ddp._get_ddp_logging_data()
        if dist.get_rank() != 0:
            continue
        print(json.dumps({
            "cap": cap, "order": first, "param_bytes": [p.numel() * p.element_size() for p in params],
            "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in params],
            "rebuilt_indices": data.get("rebuilt_per_bucket_param_indices"),
            "rebuilt_sizes": data.get("rebuilt_bucket_sizes"),
        }), flush=True)
    # a clean gloo teardown (see fsdp_train.py): torch 2.13 aborts a rank at exit now and
    # then unless every rank is past its last collective and the DDP models are gone first
    dist.barrier()
    del ddp, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
