"""A DDP script that talks: each rank prints to stdout and warns on stderr at every step
(the tests check which of these lines ``ddpscope run`` shows, and where)."""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    print(f"loss line from rank {rank}, step {step}")
    warnings.warn(f"a warning from rank {rank}, step {step}")
print(f"the script's last line, rank {rank}", file=sys.stderr)
dist.barrier()
del model
dist.destroy_process_group()
