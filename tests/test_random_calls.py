"""Random calls a forward makes as functions (paratrain/parallel/random_calls.py) draw by the layout-independent rule:
one process, the same rows cut into shares or flattened into tokens, and a tensor-parallel rank's slice all draw the
same numbers for the same sample. The multi-process layouts: tests/test_architectures.py (OPT, T5, ConvNeXt with
stochastic depth under ddp, tp, pp)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from paratrain.parallel import random_calls, randomness, step_state


class _Block(nn.Module):
    """Functional dropout on (b, t, h) (or on its tokens flattened), stochastic depth, a jitter and a shared scalar."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.flat = flat

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        b, t, h = x.shape
        keep = x.new_empty(b, 1, 1).bernoulli_(0.5)  # torchvision's and timm's stochastic depth
        dropped = F.dropout(x.reshape(b * t, h), 0.3, True).view(b, t, h) if self.flat else F.dropout(x, 0.3, True)
        return {"dropped": dropped,
                "depth": x * keep, "jitter": torch.empty_like(x).uniform_(0.9, 1.1), "noise": torch.randn(b, t, h),
                "scalar": torch.rand([]).expand(b)}


class _Model(nn.Module):
    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.block = _Block(flat)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.block(x)


def _drawn(model: nn.Module, calls: random_calls.RandomCalls, x: torch.Tensor, rows_before: int) -> Any:
    state = step_state.StepState(random_calls=calls)
    with step_state.using(state):
        randomness.set_seed(7)
        randomness.at_micro_step(3)
        randomness.set_rows_before(rows_before)
        with calls.active(x):
            return model(x)


def test_functional_draws_follow_the_samples_not_the_split() -> None:
    model = _Model()
    calls = random_calls.RandomCalls(model)
    x = torch.randn(6, 4, 8)
    whole = _drawn(model, calls, x, 0)
    parts = [_drawn(model, calls, x[:2], 0), _drawn(model, calls, x[2:], 2)]  # two replicas' shares
    for key in ("dropped", "depth", "jitter", "noise"):
        assert torch.equal(whole[key], torch.cat([p[key] for p in parts])), key
    flat = _Model(flat=True)
    assert torch.equal(_drawn(flat, random_calls.RandomCalls(flat), x, 0)["dropped"], whole["dropped"])  # (b * t, h)
    assert whole["scalar"].unique().numel() == 1 and torch.equal(parts[0]["scalar"][:1], whole["scalar"][:1])
    dropped = (whole["dropped"] == 0).float().mean()
    assert 0.2 < dropped < 0.4  # p = 0.3
    assert torch.allclose(whole["dropped"][whole["dropped"] != 0], x[whole["dropped"] != 0] / 0.7)
    assert 0.9 <= whole["jitter"].min() and whole["jitter"].max() <= 1.1
    assert abs(float(whole["noise"].std()) - 1.0) < 0.15
    assert calls.drew and not calls.other


def test_other_calls_and_own_generators_draw_from_torch() -> None:
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = torch.Generator().manual_seed(0)
            return x + torch.randint(0, 2, x.shape) + torch.rand(x.shape, generator=g)

    model = Noisy()
    calls = random_calls.RandomCalls(model)
    x = torch.zeros(2, 3)
    torch.manual_seed(0)
    got = _drawn(model, calls, x, 0)
    torch.manual_seed(0)
    want = x + torch.randint(0, 2, x.shape) + torch.rand(x.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)
    assert calls.other == ["randint in the model"]


def test_attention_dropout_draws_the_whole_heads_values_on_a_slice() -> None:
    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=True)

    model = Attention()
    calls = random_calls.RandomCalls(model)
    q = torch.randn(2, 4, 5, 8)  # (batch, heads, tokens, head width)
    with calls.recorded():
        whole = _drawn(model, calls, q, 0)
    calls.tp, calls.tp_rank = 2, 1  # rank 1 of 2 holds heads 2 and 3
    mine = _drawn(model, calls, q[:, 2:], 0)
    assert torch.allclose(mine, whole[:, 2:], atol=1e-6)
    plain = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert not torch.allclose(whole, plain)  # it did drop


def test_a_forward_that_draws_nothing_stops_the_watch() -> None:
    quiet = nn.Linear(3, 3)
    calls = random_calls.RandomCalls(quiet)
    watched = random_calls.watch(quiet, calls)
    watched(torch.randn(2, 3))
    assert not calls.watching
    noisy = _Model()
    calls = random_calls.RandomCalls(noisy)
    random_calls.watch(noisy, calls)(torch.randn(2, 3, 4))
    assert calls.watching


class _SequenceFirst(nn.Module):
    """PyTorch's own transformer layer as it is built by default (batch_first=False): its dropout modules see
    (positions, batch, features) tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.transpose(0, 1)).transpose(0, 1)


def test_a_sequence_first_layers_draws_follow_its_samples() -> None:
    model = _SequenceFirst().train()
    randomness.apply_layout_dropout(model)
    calls = random_calls.RandomCalls(model)
    x = torch.randn(6, 5, 8)  # (batch, positions, features); inside the layer (positions, batch, features)
    with torch.no_grad():
        whole = _drawn(model, calls, x, 0)
        parts = [_drawn(model, calls, x[:2], 0), _drawn(model, calls, x[2:], 2)]
    assert torch.allclose(whole, torch.cat(parts), atol=1e-6)  # the same masks for the same samples
