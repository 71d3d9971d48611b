"""A nanoGPT-style decoder, laid out as people write it: separate token and position embeddings, blocks
in an `nn.ModuleList`, attention that reshapes with the batch size (`x.view(b, t, h, d)`), dropout,
a final LayerNorm, and an LM head whose weight *is* the token embedding's (tied)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .case import seeded
from .data import SEQ, VOCAB


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = VOCAB
    block: int = SEQ
    dim: int = 32
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    causal: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.register_buffer("causal", torch.ones(cfg.block, cfg.block).tril().bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        # The reshape every tutorial writes: it bakes the batch size into a traced graph.
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
        att = att.masked_fill(~self.causal[:t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.block, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one Parameter, two modules
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.block, cfg.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))


class FlatGPT(nn.Module):
    """The other way people lay a decoder out: the embeddings one child, each block a top-level child,
    an untied head. Cut evenly into 4 stages, a stage boundary falls inside a block, so a residual is both
    sent on and used by the stage itself (zero-bubble's split backward once failed on exactly that)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed = Embeddings(cfg)
        self.block0, self.block1, self.block2 = (Block(cfg) for _ in range(3))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.block0(self.embed(idx))))
        return self.head(self.ln_f(x))


def build_flat_gpt(seed: int) -> FlatGPT:
    with seeded(seed):
        return FlatGPT(GPTConfig())


def _init(module: nn.Module) -> None:
    """GPT-2's initialisation (normal 0.02, zero biases): the defaults of nn.Embedding (std 1) make the
    tied head's first logits huge."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_gpt(seed: int, dropout: float = 0.0) -> GPT:
    with seeded(seed):
        return GPT(GPTConfig(dropout=dropout))
