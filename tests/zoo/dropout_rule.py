"""paratrain's documented dropout rule, written again here in plain PyTorch for the reference run.

Where it is used: tests/test_matrix.py and tests/test_gpu.py compare every dropout case (`applies_to`) with a
reference run whose `dropout=` is `layout_rule`. Those dropout cells are thus compared with a reference that
restates the library's rule: they show that every layout draws the rule's masks, and cannot catch a bug in
the rule itself (a mask repeated across rows, steps or layers, a wrong rate or scale), since the reference
would share it. tests/test_dropout_stats.py checks the library's masks against statistics instead (the
dropped fraction, the scale, independence across steps, rows, positions and layers, none in eval mode, the
same masks under 1 and 2 workers).

The library makes every dropout mask a function of (seed, micro-step, layer, global row, position in the
row) so that it does not depend on the layout (docs/parallelism.md, "Randomness"). The reference must
draw the very same masks, and it may not use paratrain's code, so the rule is restated from its
documentation:

    base  = the first 4 bytes (little-endian) of blake2b("{seed}/{step}/{layer}/{call}", digest_size=4)
    bits  = mix(mix(col XOR base) XOR ((row * 0x9E3779B1) mod 2**32))     (mix: Wellons' lowbias32)
    keep  = bits >= floor(p * 2**32)

`layer` is the dropout module's path in the model, `call` counts its uses within one forward, `row` is the
sample's index in the global batch and `col` the element's index within the row (whole channels for
Dropout1d/2d/3d). Kept elements are scaled by 1 / (1 - p).

Random functions a module calls are drawn from the same bits (docs/parallelism.md, "Randomness"): `layer` is the
innermost module whose forward is running (here: a stack kept by forward hooks around the reference's forward,
another mechanism than the library's), `call` counts that layer's draws in the forward. Every draw, a module's
included, is placed by its shape against the forward's batch (its input's first tensor's dim 0): dim 0 the batch is
drawn per sample; else dim 1 the batch, per sample as (batch, dim 0, ...); else dim 0 a multiple of the batch, per
sample as (batch, the rest flattened); any other as one row 0.
F.dropout keeps as above; uniform values are (bits >> 8) * 2**-24, bernoulli draws 1 where the uniform value is
below p, a normal value is sqrt(-2 ln(1 - u1)) * cos(2 pi u2) from two consecutive draws, and
scaled_dot_product_attention with dropout_p drops its softmax weights as F.dropout does, computed as its math.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .randomness import BERNOULLI, DROPOUT_MODULE, FUNCTIONAL, NOISE

_MASK = 0xFFFFFFFF

COVERS = frozenset({DROPOUT_MODULE, FUNCTIONAL, BERNOULLI, NOISE})
"""The kinds of randomness (zoo.randomness) this restatement draws as the library does. A model that draws
another kind (randint, multinomial: torch's generator, per replica) has no reference: its cells are expected to
differ from the plain loop or be refused."""


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _bits(shape: tuple[int, ...], seed: int, step: int, layer: str, call: int, first_row: int = 0) -> torch.Tensor:
    """The rule's bits of a (rows, ...) tensor, its rows numbered from `first_row`."""
    base = int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{layer}/{call}".encode(), digest_size=4).digest(), "little")
    rows, per_row = shape[0], int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
    row = torch.arange(first_row, first_row + rows, dtype=torch.int64).view(rows, 1)
    col = torch.arange(per_row, dtype=torch.int64).view(1, per_row)
    return _mix(_mix(col ^ base) ^ ((row * 0x9E3779B1) & _MASK)).view(shape)


class _RuleDropout:
    def __init__(self, module: nn.Module, name: str, state: _RuleCalls) -> None:
        self.module, self.name, self.state = module, name, state

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, state = self.module, self.state
        if not m.training or m.p == 0.0:
            return x
        channels = isinstance(m, nn.Dropout1d | nn.Dropout2d | nn.Dropout3d)
        shape = tuple(x.shape[:2] if channels else x.shape)
        keep = state.drawn_bits(shape, self.name) >= int(m.p * 2**32)
        keep = keep.to(x.device)
        if channels:
            keep = keep.view(*shape, *([1] * (x.dim() - 2)))
        return x * (keep.to(x.dtype) / (1.0 - m.p))


_DROPOUTS = {F.dropout: False, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True}
_BERNOULLI = {torch.Tensor.bernoulli_, torch.Tensor.bernoulli, torch.bernoulli}
_UNIFORM = {torch.rand, torch.rand_like, torch.Tensor.uniform_}
_NORMAL = {torch.randn, torch.randn_like, torch.Tensor.normal_}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default


class _RuleCalls(TorchFunctionMode):
    """Random functions of the reference's forward, drawn by the documented rule."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names, self.stack = names, [""]
        self.seed = self.step = self.rows = 0
        self.rows_before = 0
        """Rows of this step's batch the forwards before this one had (a micro-batch's first global row)."""
        self.calls: dict[str, int] = {}
        """Draws of each layer in this forward."""

    def drawn_bits(self, shape: tuple[int, ...], layer: str) -> torch.Tensor:
        """The bits of `layer`'s next draw of a tensor of `shape`: per sample (the sequence first where dim 1, not
        dim 0, is the batch), or one row 0."""
        call = self.calls.get(layer, 0)
        self.calls[layer] = call + 1
        seq_first = len(shape) > 1 and shape[0] != self.rows and shape[1] == self.rows
        per_sample = seq_first or (bool(shape) and shape[0] >= self.rows and shape[0] % self.rows == 0)
        if seq_first:  # drawn as (batch, sequence, ...)
            moved = (shape[1], shape[0], *shape[2:])
            bits = _bits((self.rows, int(torch.tensor(moved[1:]).prod())), self.seed, self.step, layer, call,
                         self.rows_before)
            return bits.view(moved).transpose(0, 1)
        drawn = (self.rows, -1) if per_sample else (1, -1)
        shaped = tuple(torch.empty(shape, device="meta").reshape(drawn).shape)
        return _bits(shaped, self.seed, self.step, layer, call, self.rows_before if per_sample else 0).view(shape)

    def _uniform_bits(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self.drawn_bits(shape, self.stack[-1])

    def _uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        return (self._uniform_bits(shape) >> 8).double() * 2.0**-24

    def _dropout(self, x: torch.Tensor, p: float, channels: bool) -> torch.Tensor:
        shape = tuple(x.shape[:2] if channels else x.shape)
        keep = self._uniform_bits(shape) >= int(p * 2**32)
        keep = keep.view(*shape, *([1] * (x.dim() - len(shape))))
        return x * (keep.to(x.dtype) / (1.0 - p))

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        if func in _DROPOUTS:
            x, p, training = args[0], _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
            return self._dropout(x, p, _DROPOUTS[func]) if training and p else x
        if func is F.scaled_dot_product_attention and _arg(args, kwargs, 4, "dropout_p", 0.0):
            q, k, v = args[:3]
            mask, p = _arg(args, kwargs, 3, "attn_mask", None), _arg(args, kwargs, 4, "dropout_p", 0.0)
            causal, scale = _arg(args, kwargs, 5, "is_causal", False), _arg(args, kwargs, 6, "scale", None)
            if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
                k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], -3) for t in (k, v))
            scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
            if causal:
                scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            return self._dropout(torch.softmax(scores, dim=-1), p, False) @ v
        like = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _BERNOULLI or func in _UNIFORM or func in _NORMAL:
            shape = tuple(like.shape) if like is not None else tuple(
                args[0] if len(args) == 1 and isinstance(args[0], list | tuple | torch.Size) else args)
            if func in _NORMAL:
                u1, u2 = self._uniform(shape), self._uniform(shape)
                value = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * torch.pi * u2)
                if func is torch.Tensor.normal_:
                    return like.copy_(value * _arg(args, kwargs, 2, "std", 1.0) + _arg(args, kwargs, 1, "mean", 0.0))
                return value.to(kwargs.get("dtype") or (like.dtype if like is not None else torch.float32))
            value = self._uniform(shape)
            if func is torch.Tensor.uniform_:
                low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
                return like.copy_(value * (high - low) + low)
            if func in _BERNOULLI:
                p = _arg(args, kwargs, 1, "p", 0.5 if func is torch.Tensor.bernoulli_ else like)
                drawn = (value < (p.double() if isinstance(p, torch.Tensor) else p)).to(like.dtype)
                return like.copy_(drawn) if func is torch.Tensor.bernoulli_ else drawn
            return value.to(kwargs.get("dtype") or (like.dtype if like is not None else torch.float32))
        if getattr(func, "__module__", None) == F.__name__ and hasattr(func, "__code__"):
            with self:  # multi_head_attention_forward and its kind: their own calls draw too
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        return func(*args, **kwargs)


class _RuleForward:
    """The reference model's forward inside `_RuleCalls`, with a stack of the running modules' paths (hooks)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.inner = model, model.forward
        self.mode = _RuleCalls({id(m): name for name, m in model.named_modules()})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        mode = self.mode
        if not self.model.training:
            return self.inner(*args, **kwargs)

        def enter(module: nn.Module, inputs: Any) -> None:
            mode.stack.append(mode.names.get(id(module), mode.stack[-1]))

        def leave(module: nn.Module, inputs: Any, output: Any) -> None:
            mode.stack.pop()

        first = next(t for t in (*args, *kwargs.values(), *_values(args)) if isinstance(t, torch.Tensor) and t.dim())
        mode.rows, mode.calls, mode.stack = int(first.shape[0]), {}, [""]
        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        try:
            with mode:
                return self.inner(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            mode.rows_before += mode.rows  # the next forward of this step (a micro-batch) starts after these rows


def _values(args: tuple[Any, ...]) -> list[Any]:
    return [v for a in args if isinstance(a, dict) for v in a.values()]


def layout_rule(model: nn.Module, seed: int, step: int) -> None:
    """The reference's `dropout=` rule: nn.Dropout modules and random functions draw the documented values for
    `step`."""
    calls = model.__dict__.get("forward")
    if not isinstance(calls, _RuleForward):
        calls = _RuleForward(model)
        model.forward = calls  # type: ignore[method-assign]
    calls.mode.seed, calls.mode.step, calls.mode.rows_before, calls.mode.calls = seed, step, 0, {}
    for name, module in model.named_modules():
        if type(module) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
            if not isinstance(module.__dict__.get("forward"), _RuleDropout):
                module.forward = _RuleDropout(module, name, calls.mode)  # type: ignore[method-assign]


def applies_to(model: Any) -> bool:
    return any(type(m) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d) and m.p > 0 for m in model.modules())


def covers(kinds: frozenset[str]) -> bool:
    """Whether a model drawing these kinds of randomness (zoo.randomness.kinds) has a reference: none, or only
    kinds this restatement covers."""
    return kinds <= COVERS
