"""A GPT decoder as users write one (nanoGPT's layout), for the `gpt` benchmark workload.

    tokens -> Embedding (token + position) -> Block x L (pre-norm: causal self-attention, MLP) -> Head
                                                                  (LayerNorm, Linear tied to the token embedding)

`GPT` is a plain module with an `nn.ModuleList` of blocks and a tied output projection, not an
`nn.Sequential`: paratrain's pipelines must trace it. `GPT.layers()` is the chain a hand-written
pipeline cuts by hand (embedding, each block, head); on two stages the tied weight then lives on the
first and the last stage, see `references`.

`flops_per_token` is the usual model-FLOPs formula, 6 N + 12 L T d (PaLM, appendix B; nanoGPT's
`estimate_mfu`): N counts the weights of matrix products (embedding lookups excluded, the tied head
included), attention counts QK^T and AV over the full T x T (the causal half is not subtracted), the
backward pass is twice the forward, and nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int
    """Vocabulary size (also the width of the tied output projection)."""
    seq: int
    """Tokens per sample (context length)."""
    d_model: int
    layers: int
    heads: int

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads} "
                             f"({self.d_model} % {self.heads} = {self.d_model % self.heads})")


SIZES = {
    "tiny": GPTConfig(vocab=64, seq=16, d_model=32, layers=2, heads=2),
    "mini": GPTConfig(vocab=2048, seq=128, d_model=256, layers=4, heads=4),
    "gpt2": GPTConfig(vocab=50304, seq=1024, d_model=768, layers=12, heads=12),
}
"""`tiny`: tests and smoke runs; `mini`: CPU workers (the default without GPUs); `gpt2`: GPT-2 small
(124 M parameters, vocabulary padded to 50304 as nanoGPT does), the default on GPUs."""


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, d): token plus learned position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # the batch varies with micro-batching: shapes come from the input
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Hidden states -> logits (B, T, vocab): final LayerNorm and the output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)
        self.head.proj.weight = self.embed.tok.weight  # tied, as GPT-2 and nanoGPT do
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def layers(self) -> list[nn.Module]:
        """The model as a chain (embedding, blocks, head), where a hand-written pipeline cuts it."""
        return [self.embed, *self.blocks, self.head]


def _init(module: nn.Module) -> None:
    """GPT-2's initialisation (normal, std 0.02; zero biases)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class NextTokenLoss(nn.Module):
    """Cross-entropy of logits (B, T, vocab) against the next tokens (B, T)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tokens(batch: int, cfg: GPTConfig, seed: int = 1) -> Batch:
    """Synthetic token batches from a fixed seed: inputs (B, T) and their next tokens (B, T)."""
    seq = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def matmul_parameters(cfg: GPTConfig) -> int:
    """N of the formula: weights of matrix products per token (12 d^2 per block, d x vocab in the head)."""
    return 12 * cfg.layers * cfg.d_model**2 + cfg.d_model * cfg.vocab


def flops_per_token(cfg: GPTConfig) -> int:
    """Model FLOPs of one token's forward and backward: 6 N + 12 L T d."""
    return 6 * matmul_parameters(cfg) + 12 * cfg.layers * cfg.seq * cfg.d_model
