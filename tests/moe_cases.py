"""Models of the expert- and context-parallel tests (tests/moe_worker.py under each layout, tests/test_moe.py and
tests/test_context_parallel.py in one process).

Mixtures of experts: a user decoder written the common way (a router `Linear`, top-k softmax, experts as a
`ModuleList` of feed-forward blocks, optionally the Switch load-balancing loss over the tokens its forward sees),
the same decoder with its experts in the grouped form (`user-grouped`),
and Hugging Face Mixtral and Qwen2-MoE from tiny configs with their library's defaults. Long sequences (`LONG`):
a user RoPE decoder with SDPA that takes `position_ids`, and Hugging Face Llama, at sequence 64, with its library's
defaults (`llama`: the cache on) and without its cache (`llama-nocache`, as gradient checkpointing runs it:
transformers then reads the jump in a rank's positions from its head chunk to its tail chunk as packed documents
and builds a mask for them)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

os.environ["HF_HUB_OFFLINE"] = "1"

VOCAB, SEQ, ROWS, GLOBAL_BATCH, WIDTH, EXPERTS = 64, 8, 24, 8, 32, 4
HEAD_DIM = WIDTH // 4
LONG, LONG_SEQ = ("rope", "rope-ignored", "rope-seq", "llama", "llama-nocache"), 64
AUX = 0.01
CLIP, CLIPPED = 0.5, ("user-clip", "mixtral-clip")
"""Models trained with their gradient clipped by the whole model's norm (`run.clip_grad_norm_`)."""
ADAMW = ("user-adamw",)
"""Models trained with AdamW (the others with SGD, `optimizer`): the user decoder without the attention's bias, whose
key part has a gradient that is zero in exact arithmetic, and float noise that Adam would scale to steps of lr."""


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-2 of `EXPERTS`; with `balance`, the Switch auxiliary loss over the tokens this forward sees, computed
    from the router statistics `rows` gives it (the rows themselves, or every data-parallel rank's)."""

    def __init__(self, width: int, balance: str | None) -> None:
        super().__init__()
        self.router = nn.Linear(width, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(EXPERTS))
        self.balance = balance
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        weights, chosen = probs.topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, weights[rows, slot, None] * expert(flat[rows]))
        if self.balance is not None:
            if self.balance == "global":
                import paratrain

                probs = paratrain.global_rows(probs)
            picked = probs.topk(2, dim=-1).indices
            share = F.one_hot(picked, EXPERTS).float().sum(1).mean(0)
            self.aux = EXPERTS * (share * probs.mean(0)).sum()
        return out.reshape_as(x)


class GroupedExperts(nn.Module):
    """The user's experts in the grouped form docs/parallelism.md shows: weights stacked on a first dimension of
    `num_experts`, called with each row's chosen experts and their weights (one exchange a layer under ep)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.up = nn.Parameter(torch.randn(EXPERTS, 2 * width, width) * 0.1)
        self.down = nn.Parameter(torch.randn(EXPERTS, width, 2 * width) * 0.1)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.up.shape[0]):
            rows, slot = torch.where(top_k_index == e)
            h = F.gelu(hidden_states[rows] @ self.up[e].T) @ self.down[e].T
            out = out.index_add(0, rows, top_k_weights[rows, slot, None] * h)
        return out


class GroupedMoE(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, EXPERTS, bias=False)
        self.experts = GroupedExperts(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(2, dim=-1)
        return self.experts(flat, chosen, weights / weights.sum(-1, keepdim=True)).reshape_as(x)


class Block(nn.Module):
    def __init__(self, width: int, balance: str | None, grouped: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.moe: nn.Module = GroupedMoE(width) if grouped else MoE(width, balance)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, -1, HEAD_DIM).permute(2, 0, 3, 1, 4)  # heads: what it holds
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.moe(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, balance: str | None = None, grouped: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block(WIDTH, balance, grouped) for _ in range(2))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.balance = balance

    def forward(self, ids: torch.Tensor) -> Any:
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if self.balance is None:
            return logits
        return logits, sum(block.moe.aux for block in self.blocks)  # type: ignore[misc]


class Embed(nn.Module):
    """The user decoder's token and position embedding as a block of its own (`sequential`)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) + self.pos[: ids.shape[1]]


def sequential() -> nn.Sequential:
    """The user MoE decoder written as an nn.Sequential of its blocks: pipeline stages that call them as themselves,
    which expert parallelism can live in (`ep+pp` on a user model)."""
    return nn.Sequential(Embed(), Block(WIDTH, None), Block(WIDTH, None), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


class Rope(nn.Module):
    """Rotary position embedding of the positions it is given (global ones under context parallelism)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[..., None].float() * self.inv_freq  # (batch, seq, dim/2)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class RopeBlock(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.rope = Rope(width // heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q, positions), self.rope(k, positions)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, c))
        return x + self.mlp(self.ln2(x))


class SeqRopeBlock(RopeBlock):
    """A RoPE block for an nn.Sequential: one process calls it with the hidden states alone (positions 0..length-1);
    context parallelism inside a pipeline passes each rank's global positions (`rope-seq`)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        return super().forward(x, position_ids)


class RopeDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(RopeBlock(WIDTH) for _ in range(2))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(self.ln(x))


def build(name: str) -> nn.Module:
    if name.endswith("-meta"):  # built with no storage: each rank's layout materialises its share (`plain` too)
        with torch.device("meta"):
            return build(name.removesuffix("-meta"))
    torch.manual_seed(0)
    if name in ("rope", "rope-ignored"):  # -ignored: targets of -100 the loss leaves out, unevenly over the shares
        return RopeDecoder()
    if name == "rope-seq":  # the RoPE decoder as an nn.Sequential of its blocks
        return nn.Sequential(nn.Embedding(VOCAB, WIDTH), SeqRopeBlock(WIDTH), SeqRopeBlock(WIDTH), nn.LayerNorm(WIDTH),
                             nn.Linear(WIDTH, VOCAB))
    if name in ("llama", "llama-nocache"):
        import transformers as tf

        tf.logging.set_verbosity_error()
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=LONG_SEQ, use_cache=name == "llama"))
    if name in ("user", "user-clip"):
        return Decoder()
    if name == "user-adamw":
        model = Decoder()
        for block in model.blocks:
            block.qkv.bias = None  # type: ignore[union-attr]
        return model
    if name == "user-seq":
        return sequential()
    if name == "user-grouped":
        return Decoder(grouped=True)
    if name in ("user-aux", "user-aux-global"):
        return Decoder("local" if name == "user-aux" else "global")
    import transformers as tf

    tf.logging.set_verbosity_error()
    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    if name in ("mixtral", "mixtral-aux", "mixtral-clip"):  # -aux: its load-balancing loss (output_router_logits)
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=EXPERTS, num_experts_per_tok=2,
                                                      output_router_logits=name == "mixtral-aux", **common))
    if name == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(num_experts=EXPERTS, num_experts_per_tok=2,
                                                        moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                        **common))
    raise ValueError(name)


def data(name: str = "user") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (ROWS, (LONG_SEQ if name.removesuffix("-meta") in LONG else SEQ) + 1), generator=g)
    targets = ids[:, 1:].contiguous()
    if name == "rope-ignored":
        targets[::2, :20] = -100  # every other row's first 20 targets: most of them in rank 0's head chunk
    return ids[:, :-1].contiguous(), targets


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    aux = None
    if isinstance(out, tuple):
        out, aux = out
    logits = out.logits if hasattr(out, "logits") else out
    if getattr(out, "aux_loss", None) is not None:
        aux = out.aux_loss
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return loss + AUX * aux if aux is not None else loss


def optimizer(model: nn.Module, name: str = "") -> torch.optim.Optimizer:
    if name in ADAMW:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # Adam would turn float noise on the
    # attention key bias (a gradient zero in exact arithmetic) into steps of lr: SGD keeps the comparison on the math


def plain(name: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same steps in one process: the reference every layout is held to (a meta-built model given the values
    its modules' own initialisation gives it under every layout, `paratrain.weights`)."""
    model = build(name)
    if name.endswith("-meta"):
        from paratrain import weights

        weights.materialize(model, weights.source_for(model, 0, None), torch.device("cpu"))
    opt = optimizer(model, name)
    x, y = data(name)
    losses = []
    for start in range(0, ROWS, GLOBAL_BATCH):
        loss = loss_fn(model(x[start:start + GLOBAL_BATCH]), y[start:start + GLOBAL_BATCH])
        loss.backward()
        if name in CLIPPED:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def experts_held(name: str, model: nn.Module) -> dict[str, list[int]]:
    """Per MoE layer this rank holds (a pipeline stage holds some), the experts it computes: for stacked weights,
    the rows of the whole it holds."""
    from paratrain.parallel.expert.find import find

    held: dict[str, list[int]] = {}
    for experts in find(build(name)):  # found on a fresh build: under ep the others' experts are stand-ins
        try:
            module = model.get_submodule(experts.path)
        except AttributeError:  # another pipeline stage's layer
            continue
        if experts.kind == "listed":
            held[experts.path] = [i for i, m in enumerate(module) if any(True for _ in m.parameters())]
            continue
        weight = next(iter(module.parameters()))
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if hasattr(weight, "device_mesh"):
            first = weight.device_mesh.get_local_rank() * local.shape[0]
        else:
            first = 0
        held[experts.path] = list(range(first, first + local.shape[0]))
    return held
