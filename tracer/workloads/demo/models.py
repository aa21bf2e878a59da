"""Demo models, sized so that on 2 CPU cores a step takes ~50-300 ms per rank and the
gradients (~20-25 MB fp32) fill many buckets at a 1 MB cap and one or two at 25 MB."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpscope.tracer.options import DEMO_MODELS as MODELS  # noqa: E402  (declared torch-free)


@dataclass(kw_only=True)
class MLPConfig:
    width: int = 512
    depth: int = 16
    batch: int = 128


class MLP(nn.Module):
    """Residual MLP regressing a fixed random teacher: many equal-sized layers."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(nn.Linear(cfg.width, cfg.width) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.norm(x)

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.cfg.batch, self.cfg.width, generator=gen)
        return x, torch.tanh(x.roll(1, dims=1))  # a target the model can learn

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)


@dataclass(kw_only=True)
class GPTConfig:
    vocab: int = 2048
    block: int = 64
    layers: int = 6
    heads: int = 4
    embd: int = 256
    batch: int = 2


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(cfg.embd)
        self.attn_qkv = nn.Linear(cfg.embd, 3 * cfg.embd)
        self.attn_proj = nn.Linear(cfg.embd, cfg.embd)
        self.ln_2 = nn.LayerNorm(cfg.embd)
        self.mlp_fc = nn.Linear(cfg.embd, 4 * cfg.embd)
        self.mlp_proj = nn.Linear(4 * cfg.embd, cfg.embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


class GPT(nn.Module):
    """A small GPT-2-style decoder (nanoGPT's layout) on a learnable synthetic sequence task."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.embd)
        self.wpe = nn.Embedding(cfg.block, cfg.embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.embd)
        self.lm_head = nn.Linear(cfg.embd, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # sequences counting up from a random start: next token = (token + 1) mod vocab
        start = torch.randint(0, self.cfg.vocab, (self.cfg.batch, 1), generator=gen)
        seq = (start + torch.arange(self.cfg.block + 1)) % self.cfg.vocab
        return seq[:, :-1], seq[:, 1:]

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def model_config(name: str) -> MLPConfig | GPTConfig:
    """The demo model's configuration (sizes), without building the model."""
    if name == "mlp":
        return MLPConfig()
    if name == "gpt":
        return GPTConfig()
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def build_model(name: str) -> nn.Module:
    cfg = model_config(name)
    return MLP(cfg) if isinstance(cfg, MLPConfig) else GPT(cfg)
