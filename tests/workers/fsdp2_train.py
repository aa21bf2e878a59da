"""An FSDP2 training script in torchtitan's style: a small transformer of blocks, each
block ``fully_shard``-ed, then the root; AdamW; CPU and gloo (the user's code: nothing
of ddpscope's in it).

``--report DIR``: each rank writes its final parameters' checksum and the loss (for
bit-identity against an untraced run), and with ``--memtracker`` the memory that
PyTorch's own ``FSDPMemTracker`` saw over one step (an independent instrument).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, skip_head: bool = False):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return x if skip_head else self.out(x)


def chunked_loss(model, idx, chunks: int, backward_calls: list[tuple[float, float]]):
    """torchtitan 0.3's ChunkedLossWrapper (components/loss.py), reduced: ``norm`` and the
    head ``out`` are one FSDP unit (``fully_shard([norm, out])``, as torchtitan groups
    them); the body's normed hidden states are cut in ``chunks`` along the sequence; each
    chunk runs ``out`` (kept unsharded, gradient sync on the last chunk only) and its own
    ``backward()`` inside this call; then one backward through the body with the chunks'
    gradients. Each chunk's ``backward()`` call is appended to ``backward_calls`` (µs on
    perf_counter)."""
    h = model(idx, skip_head=True)
    parts = [c.detach().requires_grad_() for c in h.split(h.shape[1] // chunks, dim=1)]
    targets = idx.roll(-1, 1).split(h.shape[1] // chunks, dim=1)
    head, total = model.out, 0.0
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    for i, (part, target) in enumerate(zip(parts, targets)):
        if i == len(parts) - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(part)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) / chunks
        t0 = time.perf_counter_ns() / 1e3
        loss.backward()
        backward_calls.append((t0, time.perf_counter_ns() / 1e3))
        total += float(loss.detach())
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    h.backward(torch.cat([p.grad for p in parts], dim=1))
    return torch.tensor(total)


def parse_reshard(text: str):
    return {"true": True, "false": False}.get(text, None) if not text.isdigit() else int(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--reshard", default="true", help="true, false, N, or mixed: the last block false, the rest true")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (no reduction but the last)")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bfloat16)")
    p.add_argument("--report")
    p.add_argument("--freeze", type=int, default=0, help="the first N blocks do not train (requires_grad=False)")
    p.add_argument("--memtracker", action="store_true")
    p.add_argument("--mix-ddp", action="store_true", help="also build a DDP model (a script that mixes both)")
    p.add_argument("--meta-init", action="store_true", help="torchtitan's way: build on meta, shard, to_empty, init")
    p.add_argument("--differ", action="store_true", help="rank 1 leaves the last block to the root unit")
    p.add_argument("--hang", default=None, help="RANK:STEP:BLOCK: that rank sleeps in that block's forward")
    p.add_argument("--fsdp1", action="store_true", help="FSDP1 (FullyShardedDataParallel) instead")
    p.add_argument("--cuda", action="store_true", help="NCCL and CUDA (tests/tracer/capture/test_cuda.py)")
    p.add_argument("--chunked-loss", type=int, default=0,
                   help="N > 0: torchtitan's chunked loss in N chunks, each running its own backward")
    p.add_argument("--hsdp", type=int, default=1, help="R > 1: HSDP, R replicas of world/R shards (a 2-D mesh)")
    p.add_argument("--unshard-first", action="store_true",
                   help="model.unshard() before each step's forward (PyTorch's FSDP2 example), and after each "
                        "step an evaluation forward under no_grad, unsharded first too")
    p.add_argument("--prefetch", default=None, metavar="F,B",
                   help="explicit prefetching as PyTorch's FSDP2 example sets it: each block all-gathers the next F "
                        "blocks ahead of its forward and the B before it ahead of its backward")
    p.add_argument("--clip", type=float, default=0.0,
                   help="M > 0: clip_grad_norm_(model.parameters(), M) before each optimizer step (DTensor's "
                        "all-reduce of the norm), its norms reported")
    p.add_argument("--loss-allreduce", action="store_true",
                   help="all-reduce a copy of the loss after backward, before the optimizer step (the script's own)")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    try:
        torch.manual_seed(0)
        if args.meta_init:
            with torch.device("meta"):
                model = Model(args.vocab, args.dim, args.layers)
        else:
            model = Model(args.vocab, args.dim, args.layers).to(device)
        for block in model.layers[:args.freeze]:  # a partial fine-tune: these train no more
            block.requires_grad_(False)
        if args.hang:
            h_rank, h_step, h_block = (int(x) for x in args.hang.split(":"))
            calls = [0]

            def stall(module, inputs):
                calls[0] += 1
                if rank == h_rank and calls[0] == h_step + 1:
                    import time
                    time.sleep(10**6)

            model.layers[h_block].w1.register_forward_pre_hook(stall)
        if args.fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(args.steps):
                model(torch.randint(0, args.vocab, (args.batch, args.seq))).sum().backward()
                opt.step()
                opt.zero_grad()
            if args.report:
                os.makedirs(args.report, exist_ok=True)
                with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
                    json.dump({"done": True}, f)
            dist.barrier()
            del model, opt
            gc.collect()
            return
        mesh = init_device_mesh(device.type, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard")) \
            if args.hsdp > 1 else init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else \
            MixedPrecisionPolicy()
        reshard = True if args.reshard == "mixed" else parse_reshard(args.reshard)
        for k, block in enumerate(model.layers):
            if args.differ and rank == 1 and k == len(model.layers) - 1:
                continue
            last = args.reshard == "mixed" and k == len(model.layers) - 1  # used at once by backward: kept
            fully_shard(block, mesh=mesh, reshard_after_forward=False if last else reshard, mp_policy=mp)
        if args.chunked_loss:
            fully_shard([model.norm, model.out], mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        if args.prefetch:  # distributed/FSDP2/example.py's set_modules_to_{forward,backward}_prefetch
            ahead, behind = (int(x) for x in args.prefetch.split(","))
            blocks = list(model.layers)
            for i, block in enumerate(blocks):
                if i < len(blocks) - ahead:
                    block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
                if i >= behind:
                    block.set_modules_to_backward_prefetch([blocks[i - j] for j in range(1, behind + 1)])
        if args.meta_init:
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        if args.mix_ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            side = DDP(nn.Linear(4, 4))
            side(torch.randn(2, 4)).sum().backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1000 + rank)
        losses, tracker_report, step_ms, norms, means = [], None, [], [], []
        backward_calls: list[tuple[float, float]] = []  # each loss chunk's backward() call (--chunked-loss)
        for step in range(args.steps):
            t0 = time.perf_counter()
            tracker = None
            if args.memtracker and step == args.steps - 1:
                from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

                tracker = FSDPMemTracker(model, opt)
                tracker.track_inputs((torch.zeros(args.batch, args.seq, dtype=torch.long),))
                tracker.__enter__()
            if args.unshard_first:  # the root's all-gather before the step's forward, by the script
                model.unshard()
            for micro in range(args.accum):
                model.set_requires_gradient_sync(micro == args.accum - 1)
                idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
                if args.chunked_loss:
                    loss = chunked_loss(model, idx, args.chunked_loss, backward_calls)
                    continue
                logits = model(idx)
                loss = F.cross_entropy(logits.view(-1, args.vocab), idx.roll(-1, 1).view(-1))
                (loss / args.accum).backward()
            if args.loss_allreduce:  # the script's own collective, inside the step
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                means.append(float(mean) / world)
            if args.clip:  # the norm of DTensor gradients: partial on each rank, all-reduced by DTensor
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).full_tensor()))
            opt.step()
            opt.zero_grad()
            step_ms.append((time.perf_counter() - t0) * 1e3)  # the script's own clock, not ddpscope's
            if args.unshard_first:  # an evaluation between steps: its all-gathers are no step's
                model.unshard()
                with torch.no_grad():
                    model(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device))
            losses.append(float(loss.detach()))
            if tracker is not None:
                tracker.__exit__(None, None, None)
                peak = tracker.get_tracker_snapshot("peak")
                tracker_report = {str(dev): {str(k): int(v) for k, v in snap.items()}
                                  for dev, snap in peak.items()} if isinstance(peak, dict) else None
                del tracker
        if args.report:
            os.makedirs(args.report, exist_ok=True)
            digest = hashlib.sha256()
            for name, param in sorted(model.named_parameters()):
                digest.update(name.encode())
                digest.update(param.to_local().detach().cpu().numpy().tobytes())
            with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
                json.dump({"params_sha256": digest.hexdigest(), "losses": losses, "memtracker": tracker_report,
                           "step_ms": step_ms, "norms": norms, "loss_means": means,
                           "chunk_backward_us": backward_calls}, f)
        # a clean gloo teardown (see fsdp_train.py)
        dist.barrier()
        del model, opt
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
