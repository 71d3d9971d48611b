"""What the expert and context terms read from a model: its experts and its attention, seen on the example.

The model runs one forward on the profiling example under a `TorchFunctionMode` (torch's `ModuleTracker` says
which layer is running), with nothing installed on its modules:

- experts: the mixture-of-experts modules the runtime would split (`parallel.expert.find`), their parameters, and,
  from the router's `F.linear` call (its weight has one row per expert), the tokens and hidden size it routes;
  for listed experts the rows each expert's first `F.linear` receives, which give top-k and the load of each
  expert-parallel rank (the imbalance factor). Grouped experts take their rows inside one call: their top-k is
  read from the block (`top_k` / `num_experts_per_tok`) and their load is taken as even, which the profile says;
- attention: each `F.scaled_dot_product_attention` call, its keys' and values' bytes and the sequence length, and
  whether one passes its own mask or dropout (context parallelism refuses those at the first forward);
  and, where the model takes `position_ids` (context parallelism's condition), one call timed as causal and as a
  context-parallel rank runs it (half the queries against every key, an explicit causal mask).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ..parallel.context import gives_positions
from ..parallel.expert.find import find
from .costs import AxisFacts


@dataclass
class Facts:
    layers: dict[str, AxisFacts] = field(default_factory=dict)
    top_k: int = 0
    sequence: int = 0
    position_ids: bool = False
    context_refused: str | None = None
    """Why context parallelism would refuse the model's attention at its first forward (None: it would not)."""
    attention_call: tuple[torch.Size, torch.Size, torch.dtype] | None = None
    """(query shape, key shape, dtype) of the first attention call, for `time_attention`."""
    notes: list[str] = field(default_factory=list)


def _layer_of(path: str, names: list[str]) -> str | None:
    return next((n for n in names if path == n or path.startswith(n + ".")), None)


class _Watch(TorchFunctionMode):
    """Records router and expert `F.linear` calls and attention calls, attributed to the layer running them."""

    def __init__(self, routers: dict[int, str], firsts: dict[int, tuple[str, int]], layer_now: Callable[[], str | None]
                 ) -> None:
        super().__init__()
        self.routers, self.firsts, self.layer_now = routers, firsts, layer_now
        self.routed: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        """Layer -> (tokens, hidden, bytes per value) of each router call."""
        self.rows: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.attention: list[tuple[str | None, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.unshareable: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:
            x, weight = args[0], args[1]
            if id(weight) in self.routers:
                hidden = weight.shape[1]
                self.routed[self.routers[id(weight)]].append((x.numel() // hidden, hidden, x.element_size()))
            elif id(weight) in self.firsts:
                layer, index = self.firsts[id(weight)]
                self.rows[layer][index] += x.numel() // weight.shape[1]
        elif func is F.scaled_dot_product_attention and len(args) >= 3:
            self.attention.append((self.layer_now(), args[0], args[1], args[2]))
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if mask is not None or dropout:  # what `parallel.context` refuses at the first forward
                self.unshareable = "an attention call passes its own mask" if mask is not None else \
                    "attention dropout is on"
        return func(*args, **kwargs)


def _top_k(block: nn.Module) -> int:
    for module in block.modules():
        for name in ("top_k", "num_experts_per_tok"):
            value = getattr(module, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def measure(model: nn.Module, example: Any, names: list[str]) -> Facts:
    """The facts of `model` (its chain of layers named `names`), from one forward on `example`."""
    from torch.utils.module_tracker import ModuleTracker

    facts = Facts(position_ids=gives_positions(model))  # the runtime's own condition (apply_cp)
    found = find(model)
    routers: dict[int, str] = {}
    router_widths: dict[int, tuple[str, int]] = {}
    firsts: dict[int, tuple[str, int]] = {}
    for experts in found:
        layer = _layer_of(experts.path, names)
        if layer is None:
            continue
        module = model.get_submodule(experts.path)
        held = [p for p in module.parameters()]
        into = facts.layers.setdefault(layer, AxisFacts())
        into.experts, into.expert_kind = experts.count, experts.kind
        into.moe_modules += 1
        into.expert_params += sum(p.numel() for p in held)
        into.expert_tensors += len(held)
        block = model.get_submodule(experts.block) if experts.block else model
        facts.top_k = facts.top_k or _top_k(block)
        mine = {id(p) for p in held}
        for p in block.parameters():
            if id(p) not in mine and p.dim() == 2 and p.shape[0] == experts.count:
                routers[id(p)] = layer
                router_widths[id(p)] = (layer, p.shape[1])
        if experts.kind == "listed":
            for index, expert in enumerate(module.children()):
                first = next((p for p in expert.parameters() if p.dim() == 2), None)
                if first is not None:
                    firsts[id(first)] = (layer, index)
    root = type(model).__name__
    tracker = ModuleTracker()

    def layer_now() -> str | None:
        return next((n for n in names if f"{root}.{n}" in tracker.parents), None)

    watch = _Watch(routers, firsts, layer_now)
    flops = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), tracker, watch, flops:
            model(example)
    except (RuntimeError, NotImplementedError) as exc:  # data-dependent routing on a meta model, for one
        facts.notes.append(f"the model's forward could not be watched ({str(exc).splitlines()[0][:120]}): routing "
                           "and attention not measured; routed bytes estimated as the example's tokens x top-k x "
                           "the router's width x 4")
        tokens = _tokens_per_sample(example)
        for layer, into in facts.layers.items():
            widths = [int(hidden) for weight, (where, hidden) in router_widths.items() if where == layer]
            into.routed_bytes = sum(tokens * max(1, facts.top_k) * w * 4 for w in widths)
        return facts
    counted = {k: sum(v.values()) for k, v in flops.get_flop_counts().items()}
    for experts in found:
        layer = _layer_of(experts.path, names)
        whole = counted.get(f"{root}.{layer}", 0)
        if layer is not None and whole:
            path = f"{root}.{experts.path}"  # a ModuleList is never called: its experts are
            spent = counted.get(path) or sum(v for k, v in counted.items()
                                             if k.startswith(path + ".") and "." not in k[len(path) + 1 :])
            facts.layers[layer].expert_share += spent / whole
    for layer, calls in watch.routed.items():
        into = facts.layers[layer]
        rows = watch.rows.get(layer, {})
        if rows and into.expert_kind == "listed":
            into.expert_rows = tuple(rows.get(i, 0) for i in range(into.experts))
            tokens = sum(t for t, _, _ in calls)
            facts.top_k = max(1, round(sum(into.expert_rows) / tokens)) if tokens else facts.top_k
    batch = _rows(example)
    for layer, calls in watch.routed.items():
        top_k = facts.top_k or 1
        facts.layers[layer].routed_bytes = sum(t * top_k * h * b for t, h, b in calls) / batch
    if found and not facts.top_k:
        facts.notes.append("top-k not found on the MoE blocks: 1 assumed")
    if any(x.expert_kind == "grouped" for x in facts.layers.values()):
        facts.notes.append("grouped experts' load is not measured: expert imbalance 1.0 assumed")
    facts.context_refused = watch.unshareable
    for layer, query, key, value in watch.attention:
        if layer is None:
            continue
        into = facts.layers.setdefault(layer, AxisFacts())
        into.attention_calls += 1
        into.kv_bytes += (key.numel() * key.element_size() + value.numel() * value.element_size()) / query.shape[0]
        facts.sequence = facts.sequence or int(key.shape[-2])
        if facts.attention_call is None:
            facts.attention_call = (query.shape, key.shape, query.dtype)
    return facts


def _tokens_per_sample(example: Any) -> int:
    """Tokens of one sample: the first input's elements per row (a (batch, sequence) tensor of token ids)."""
    from .._tree import tensors_in

    found = [t for t in tensors_in(example) if t.dim() > 0]
    return int(found[0].numel() // found[0].shape[0]) if found else 1


def _rows(example: Any) -> int:
    from .._tree import tensors_in

    found = [t.shape[0] for t in tensors_in(example) if t.dim() > 0]
    return int(found[0]) if found else 1


def _seconds(fn: Callable[[], torch.Tensor], repeats: int = 5) -> tuple[float, float]:
    """(forward, backward) seconds of an attention call, the fastest of `repeats` after a warm-up."""
    fn().sum().backward()
    forward = backward = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        middle = time.perf_counter()
        out.sum().backward()
        end = time.perf_counter()
        forward, backward = min(forward, middle - start), min(backward, end - middle)
    return forward, backward


def time_attention(query: torch.Size, key: torch.Size, dtype: torch.dtype, batch: int,
                   device: torch.device) -> tuple[tuple[float, float], float]:
    """((forward, backward) seconds per sample of causal attention at `batch` samples, the masked factor): half the
    queries against every key under an explicit causal mask, as a context-parallel rank of 2 attends, over half
    the causal call's seconds."""
    shape_q = (batch, *query[1:])
    shape_k = (batch, *query[1:-2], *key[-2:])  # grouped keys and values timed as one per query head

    def leaf(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, dtype=dtype, device=device, requires_grad=True)

    q, k, v = leaf(shape_q), leaf(shape_k), leaf(shape_k)
    causal = _seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    length = shape_k[-2]
    quarter = length // 4
    positions = torch.cat([torch.arange(quarter), torch.arange(length - quarter, length)]).to(device)
    mask = torch.arange(length, device=device)[None, :] <= positions[:, None]
    half = leaf((*shape_q[:-2], len(positions), shape_q[-1]))
    masked = _seconds(lambda: F.scaled_dot_product_attention(half, k, v, attn_mask=mask))
    whole = sum(causal)
    factor = sum(masked) / (whole / 2) if whole and quarter else 1.0
    return (causal[0] / batch, causal[1] / batch), factor
