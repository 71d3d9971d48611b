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
    experts: int = 0
    """Feed-forward experts per block (0: one dense MLP), each half the dense MLP's width."""
    top_k: int = 2
    """Experts each token is routed to."""

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads} "
                             f"({self.d_model} % {self.heads} = {self.d_model % self.heads})")


SIZES = {
    "tiny": GPTConfig(vocab=64, seq=16, d_model=32, layers=2, heads=2),
    "mini": GPTConfig(vocab=2048, seq=128, d_model=256, layers=4, heads=4),
    "gpt2": GPTConfig(vocab=50304, seq=1024, d_model=768, layers=12, heads=12),
    "moe": GPTConfig(vocab=2048, seq=128, d_model=256, layers=4, heads=4, experts=8, top_k=2),
    "long": GPTConfig(vocab=2048, seq=1024, d_model=256, layers=4, heads=4),
    "tiny-moe": GPTConfig(vocab=64, seq=16, d_model=32, layers=2, heads=2, experts=4, top_k=2),
    "tiny-long": GPTConfig(vocab=64, seq=64, d_model=32, layers=2, heads=2),
}
"""`tiny`: tests and smoke runs; `mini`: CPU workers (the default without GPUs); `gpt2`: GPT-2 small
(124 M parameters, vocabulary padded to 50304 as nanoGPT does), the default on GPUs. `moe`: `mini` with a
mixture of 8 experts, top-2, in every block (each expert half the dense MLP: the same FLOPs per token as `mini`
at four times its MLP weights), for expert parallelism; `long`: `mini` at 1,024 tokens per sequence, for context
parallelism. `tiny-moe` and `tiny-long` are their test sizes."""


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, d): token plus learned position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
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
    def __init__(self, cfg: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class MoE(nn.Module):
    """A mixture of experts as users write one (Switch/Mixtral routing): a router `Linear`, softmax, the top-k
    experts' weights renormalised, each expert an MLP called on the rows routed to it. No token is dropped."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, 2 * cfg.d_model) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, weights[rows, slot, None] * expert(flat[rows]))
        return out.reshape_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = MoE(cfg) if cfg.experts else MLP(cfg)

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

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (batch, seq): where each token sits in its sequence, when the model sees a share of it
        (context parallelism gives every rank its chunks' global positions)."""
        x = self.embed(idx, None if position_ids is None else position_ids[0])
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
    """N of the formula: weights of matrix products per token (12 d^2 per block, d x vocab in the head); a mixture
    of experts counts the experts a token is routed to (top-k x 4 d^2) and its router."""
    mlp = cfg.top_k * 4 * cfg.d_model**2 + cfg.d_model * cfg.experts if cfg.experts else 8 * cfg.d_model**2
    return cfg.layers * (4 * cfg.d_model**2 + mlp) + cfg.d_model * cfg.vocab


def flops_per_token(cfg: GPTConfig) -> int:
    """Model FLOPs of one token's forward and backward: 6 N + 12 L T d."""
    return 6 * matmul_parameters(cfg) + 12 * cfg.layers * cfg.seq * cfg.d_model
