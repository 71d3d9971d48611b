"""Random calls a forward makes as functions follow the samples, as `nn.Dropout` modules do (`randomness`).

Models call randomness as functions: Hugging Face's OPT and BART `nn.functional.dropout(h, p, training)`, eager
attention's dropout of the attention weights, `scaled_dot_product_attention(..., dropout_p=p)`, torchvision's and
timm's stochastic depth `x.new_empty(n, 1, 1, 1).bernoulli_(keep)`, a router's jitter `uniform_`. torch draws those
from a per-process generator, so they change with the layout: another number of workers, another rank in a
tensor-parallel group, another cut of the batch. While a prepared model runs in training mode, a torch function
mode (`RandomCalls`) draws them instead from paratrain's counter-based hash, keyed like the modules' masks by
(seed, micro-step, layer, global row, position in the row), where `layer` is the path of the innermost module of the
user's model whose forward is running and the call's number within it:

- drawn by the rule: `F.dropout`, `F.dropout1d/2d/3d`, `Tensor.bernoulli(_)`, `torch.bernoulli`, `torch.rand(_like)`,
  `Tensor.uniform_`, `torch.randn(_like)`, `Tensor.normal_`: per sample where dim 0 is the forward's batch, else as
  one row shared by all samples (the same in every layout where its shape does not depend on the batch);
- `scaled_dot_product_attention(dropout_p > 0)`: the attention computed as its math, its weights' dropout by the rule;
- torch's generator (`OTHER`): `randint`, `randperm`, `multinomial`, `normal`, `Tensor.random_`, `exponential_`, ...,
  and any call given its own `generator=`: the same on every rank of a tensor-parallel group and of a pipeline (seeded
  by the data-parallel replica), other across replicas.

Under tensor parallelism a call may draw for a slice of a tensor (the local heads of attention weights): the shapes
each call had in the whole model are recorded when `prepare` checks the sharded model on the example batch, and a
rank's slice draws the whole tensor's values at its positions (`sharded`).

The mode costs a Python call per torch function; a model whose first training forward draws nothing this way runs
without it from then on.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from types import FunctionType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .. import _forwards
from .._tree import tensors_in
from ..errors import ParatrainError
from . import randomness, step_state

_DROPOUTS: dict[Any, bool] = {F.dropout: False, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True}
"""Dropout functions -> whether they drop whole channels."""
_BERNOULLI = {torch.Tensor.bernoulli_, torch.Tensor.bernoulli, torch.bernoulli}
_UNIFORM = {torch.rand, torch.rand_like, torch.Tensor.uniform_}
_NORMAL = {torch.randn, torch.randn_like, torch.Tensor.normal_}
_ATTENTION = F.scaled_dot_product_attention
_OTHER = {torch.randint, torch.randint_like, torch.randperm, torch.multinomial, torch.Tensor.multinomial,
          torch.normal, torch.poisson, torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
          torch.Tensor.cauchy_, torch.Tensor.log_normal_, F.alpha_dropout, F.feature_alpha_dropout, F.rrelu}
"""Random functions drawn from torch's generator (`OTHER` calls in the docs' table)."""

Shape = tuple[int, ...]
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
"""Calls a function's implementation one level below its __torch_function__ dispatch (torch >= 2.10)."""


class RandomCalls:
    """One run's draws of random functions: which module is which layer, the batch of the forward in flight, and
    under tensor parallelism the whole shapes of the calls that draw for a slice."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.rows = 0
        """The forward in flight's samples (its input's dim 0)."""
        self.watching = True
        """False once a training forward drew nothing here: later forwards run without the mode."""
        self.drew = False
        self.other: list[str] = []
        """The OTHER calls seen (their functions and layers), for the docs' and the pipelines' refusals."""
        self.whole: dict[tuple[str, int], Shape] | None = None
        """Recorded shapes (without the batch dimension) of each (layer, call) in the whole model."""
        self.recording = False
        self.tp_rank, self.tp = 0, 1
        self.said = False

    def reads(self, inputs: Any) -> None:
        """The forward about to run takes `inputs`: its samples are its first tensor's dim 0."""
        tensors = [t for t in tensors_in(inputs) if t.dim()]
        self.rows = int(tensors[0].shape[0]) if tensors else 0

    def layout(self, shape: Shape) -> randomness.Layout:
        """Where a tensor drawn now holds its samples (`randomness.sample_layout`)."""
        return randomness.sample_layout(shape, self.rows)

    @contextmanager
    def active(self, inputs: Any) -> Iterator[None]:
        """Inside, random functions draw by the rule; the forward's batch is read from `inputs`."""
        before, self.drew = self.drew, False
        self.reads(inputs)
        try:
            with _Mode(self):
                yield
        finally:
            self.drew = self.drew or before

    @contextmanager
    def recorded(self) -> Iterator[None]:
        """Inside (the whole model's forward), each call's shape is kept for the sharded model's slices."""
        self.whole, self.recording = {}, True
        try:
            yield
        finally:
            self.recording = False

    def layer(self) -> str:
        """The path of the innermost module of the model whose forward is on the stack."""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None:
                name = self.names.get(id(owner))
                if name is not None:
                    return name
            frame = frame.f_back  # type: ignore[assignment]
        return ""

    def cols(self, key: str, call: int, shape: Shape) -> torch.Tensor | None:
        """Positions in the whole tensor's rows of a slice's elements (None: the call draws for a whole tensor)."""
        if self.recording and self.whole is not None:
            self.whole[(key, call)] = shape
            return None
        whole = self.whole.get((key, call)) if self.whole is not None else None
        if whole is None or whole == shape:
            return None
        split = [d for d in range(len(shape)) if len(whole) == len(shape) and whole[d] != shape[d]]
        if len(split) != 1 or whole[split[0]] != shape[split[0]] * self.tp:
            raise ParatrainError(
                f"randomness: {key or 'the model'} draws a tensor of shape {shape} on each tensor rank where the whole "
                f"model drew {whole}, which is not a slice paratrain can place: its masks would differ from one "
                "process's; set that probability to 0 under tensor parallelism, or use a data-parallel layout")
        d = split[0]
        index = torch.arange(math.prod(whole), dtype=torch.int64).view(whole)
        return index.narrow(d, self.tp_rank * shape[d], shape[d]).reshape(-1)


def rule_bits(calls: RandomCalls | None, shape: Shape, key: str, call: int, device: torch.device,
              layout: randomness.Layout) -> torch.Tensor:
    """The rule's 32-bit integers for a tensor of `shape` drawn as `key`'s `call`-th draw, its samples where
    `layout` says (`randomness.Layout`)."""
    cols = calls.cols(key, call, randomness.drawn_shape(shape, layout)[1:]) if calls is not None else None
    return randomness.layout_bits(shape, key, call, device, layout, cols)


def rule_dropout(calls: RandomCalls | None, x: torch.Tensor, p: float, key: str, call: int,
                 layout: randomness.Layout, channels: bool) -> torch.Tensor:
    """nn.Dropout's rule: kept where the bits reach p * 2**32, scaled by 1 / (1 - p)."""
    shape = tuple(x.shape[:2] if channels else x.shape)
    keep = rule_bits(calls, shape, key, call, x.device, layout) >= min(int(p * 2**32), 2**32)
    keep = keep.view(*shape, *([1] * (x.dim() - len(shape))))
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p))) if p < 1.0 else x * 0.0


def rule_uniform(calls: RandomCalls | None, shape: Shape, key: str, call: int, device: torch.device,
                 layout: randomness.Layout) -> torch.Tensor:
    """Uniform floats in [0, 1) with 24 bits (exact in float32), in float64."""
    return (rule_bits(calls, shape, key, call, device, layout) >> 8).double() * 2.0**-24


def attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, is_causal: bool,
                   scale: float | None, enable_gqa: bool, drop: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """scaled_dot_product_attention as its math (torch's reference form), the weights passed through `drop`."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scores = (query @ key.transpose(-2, -1)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if is_causal:
        lower = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~lower, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return drop(torch.softmax(scores, dim=-1)) @ value


class _Mode(TorchFunctionMode):
    def __init__(self, calls: RandomCalls) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:  # the caller's own generator: its numbers are the caller's choice
            return func(*args, **kwargs)
        if func in _DROPOUTS:
            return self._dropout(func, *args, **kwargs)
        if func in _BERNOULLI or func in _UNIFORM or func in _NORMAL:
            return self._draw(func, args, kwargs)
        if func is _ATTENTION and _argument(args, kwargs, 4, "dropout_p", 0.0):
            return self._attention(*args, **kwargs)
        if func in _OTHER:
            self.calls.drew = True
            self.calls.other.append(f"{getattr(func, '__name__', func)} in {self.calls.layer() or 'the model'}")
        if _REDISPATCH is not None and isinstance(func, FunctionType) and func.__module__ == F.__name__:
            with self:  # a function of torch.nn.functional (multi_head_attention_forward): its own calls are seen too
                return _REDISPATCH(func, types, args, kwargs)
        return func(*args, **kwargs)

    def _next(self, shape: Shape) -> tuple[str, int, randomness.Layout]:
        """(layer, call, where the samples lie) of a draw now."""
        key = self.calls.layer()
        self.calls.drew = True
        return key, randomness.next_call(key), self.calls.layout(shape)

    def _dropout(self, func: Any, x: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        channels = _DROPOUTS[func]
        key, call, layout = self._next(tuple(x.shape[:2] if channels else x.shape))
        out = rule_dropout(self.calls, x, p, key, call, layout, channels)
        return x.copy_(out) if inplace else out

    def _uniform(self, shape: Shape, device: torch.device) -> torch.Tensor:
        key, call, layout = self._next(shape)
        return rule_uniform(self.calls, shape, key, call, device, layout)

    def _draw(self, func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        like = args[0] if args and isinstance(args[0], torch.Tensor) else None
        shape = tuple(like.shape) if like is not None else _size(args, kwargs)
        device = like.device if like is not None else torch.device(kwargs.get("device") or "cpu")
        dtype = kwargs.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
        if func in _NORMAL:
            u1, u2 = self._uniform(shape, device), self._uniform(shape, device)
            value = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)
            if func is torch.Tensor.normal_:
                mean, std = _argument(args, kwargs, 1, "mean", 0.0), _argument(args, kwargs, 2, "std", 1.0)
                return like.copy_(value * std + mean)  # type: ignore[union-attr]
        else:
            value = self._uniform(shape, device)
        if func is torch.Tensor.uniform_:
            low, high = _argument(args, kwargs, 1, "from", 0.0), _argument(args, kwargs, 2, "to", 1.0)
            return like.copy_(value * (high - low) + low)  # type: ignore[union-attr]
        if func in _BERNOULLI:
            p = _argument(args, kwargs, 1, "p", None)
            if p is None:
                p = like if func is not torch.Tensor.bernoulli_ else 0.5
            drawn = (value < (p.double() if isinstance(p, torch.Tensor) else p)).to(like.dtype)  # type: ignore[union-attr]
            return like.copy_(drawn) if func is torch.Tensor.bernoulli_ else drawn  # type: ignore[union-attr]
        return value.to(dtype)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        """scaled_dot_product_attention's math, its weights dropped by the rule."""
        return attention_math(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                              lambda w: self._dropout(F.dropout, w, dropout_p, True))


def _argument(args: Any, kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _size(args: Any, kwargs: dict[str, Any]) -> Shape:
    size = kwargs.get("size", args)
    if len(size) == 1 and isinstance(size[0], list | tuple | torch.Size):
        size = size[0]
    return tuple(int(s) for s in size)


REASON = "layout-independent random calls"


def watch(model: nn.Module, calls: RandomCalls, compiling: bool = False,
          say: Callable[[str], None] = print) -> nn.Module:
    """The prepared model's training forwards draw random calls through `calls` (until one draws nothing).

    Compiled code does not run under the mode: torch.compile would trace the mode's Python into every graph. So with
    `compiling`, a forward under the mode runs its compiled pieces eagerly: the first, which decides, and, for a
    model whose forward draws random functions, every one (said once)."""
    forward = model.forward

    def watched(*args: Any, **kwargs: Any) -> Any:
        if not model.training:
            return forward(*args, **kwargs)
        if not calls.watching:
            calls.reads((args, kwargs))  # nn.Dropout modules place their samples by it
            return forward(*args, **kwargs)
        eager = torch.compiler.set_stance("force_eager") if compiling else nullcontext()
        with calls.active((args, kwargs)), eager:
            out = forward(*args, **kwargs)
        if not calls.drew:
            calls.watching = False
        elif compiling and not calls.said:
            calls.said = True
            say("paratrain: compile: the forward draws random functions (F.dropout, bernoulli_, ...), which paratrain "
                "draws eagerly by its layout-independent rule; this model's compiled pieces run eagerly (use "
                "nn.Dropout modules, which draw inside compiled code, to compile it)")
        return out

    _forwards.replace(model, watched, REASON)
    return model


@contextmanager
def replaying(calls: RandomCalls | None) -> Iterator[None]:
    """Around a recomputation (activation checkpointing): the mode again, if the forward ran under it."""
    if calls is None or not calls.watching:
        yield
        return
    with _Mode(calls):
        yield


def graph_dropout(x: torch.Tensor, p: float, key: str, call: int, layout: randomness.Layout,
                  channels: bool) -> torch.Tensor:
    """Dropout called as a function, as a traced pipeline stage calls it (its layer, call and layout settled when
    the graph was rewritten): the rule's mask, as the eager forward draws it."""
    return rule_dropout(step_state.active().random_calls, x, p, key, call, layout, channels)


def graph_bernoulli(x: torch.Tensor, p: Any, key: str, call: int, layout: randomness.Layout,
                    in_place: bool) -> torch.Tensor:
    """`bernoulli(_)` in a traced stage: 1 with probability p (a number, or `x` itself as probabilities)."""
    value = rule_uniform(step_state.active().random_calls, tuple(x.shape), key, call, x.device, layout)
    drawn = (value < (p.double() if isinstance(p, torch.Tensor) else p)).to(x.dtype)
    return x.copy_(drawn) if in_place else drawn


def graph_attention(query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
                    is_causal: bool, scale: float | None, enable_gqa: bool, key: str, call: int,
                    layout: randomness.Layout) -> torch.Tensor:
    """scaled_dot_product_attention with dropout in a traced stage: its math, the weights dropped by the rule."""
    calls = step_state.active().random_calls
    return attention_math(query, key_, value, attn_mask, is_causal, scale, enable_gqa,
                          lambda w: rule_dropout(calls, w, dropout_p, key, call, layout, False))
