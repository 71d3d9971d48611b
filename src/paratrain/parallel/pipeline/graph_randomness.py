"""The random ops of a traced model become paratrain's layout-independent draws, as the eager forward draws them
(`parallel.randomness` for nn.Dropout modules, `parallel.random_calls` for random functions), so a pipeline stage
draws the same numbers for a sample whichever stage, rank or micro-batch runs it.

Each op is keyed as the eager draw is: by the path of the innermost module it ran in (`nn_module_stack`) and its
number among that layer's draws in one forward (graph order is the forward's order). Where a draw's samples lie is
read from its shape's symbols: dim 0 the batch's symbol, or a multiple of it (tokens flattened sample by sample), or
dim 1 the batch's symbol (the sequence first); anything else is drawn as one row. Random ops the rule does not
draw are refused by name: a stage would draw them from its own generator, so they would follow the layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ...errors import ParatrainError
from .. import random_calls, randomness
from .tracing import module_path, module_types

aten = torch.ops.aten
_MODULE_DROPOUTS = {aten.dropout.default: False, aten.feature_dropout.default: True}
_BERNOULLI = {aten.bernoulli_.float: True, aten.bernoulli_.Tensor: True, aten.bernoulli.p: False,
              aten.bernoulli.default: False}
_ATTENTION = aten.scaled_dot_product_attention.default
_REFUSED = frozenset({
    "alpha_dropout", "feature_alpha_dropout", "rand", "rand_like", "randn", "randn_like", "uniform_", "normal_",
    "randint", "randint_like", "randperm", "multinomial", "exponential_", "random_", "geometric_", "cauchy_",
    "log_normal_", "normal", "poisson", "rrelu", "native_dropout", "bernoulli",
})
"""Random ops a traced stage would draw from its own generator."""


def _batch_symbols(gm: fx.GraphModule) -> list[Any]:
    """The symbols of the inputs' batch dimension (traced dynamic: `tracing.dynamic_shapes`)."""
    found: list[Any] = []
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
            found.append(val.shape[0].node.expr)
    return found


def _layout(node: fx.Node, batch: list[Any]) -> randomness.Layout:
    """Where the node's value holds the samples, read off its shape's symbols as the eager rule reads sizes
    (`randomness.sample_layout`): dim 0 the batch's symbol; else dim 1 it (the sequence first); else dim 0 a
    multiple of it (tokens flattened); else not per sample."""
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    ratios = [_ratio(size, batch) for size in shape[:2]]
    if ratios and ratios[0] == 1:
        return randomness.ROWS
    if len(ratios) > 1 and ratios[1] == 1:
        return (1, 1)
    return (0, ratios[0]) if ratios and ratios[0] > 1 else (0, 0)


def _ratio(size: Any, batch: list[Any]) -> int:
    """k where `size` is k times the batch's symbol (0: it is not)."""
    if not isinstance(size, torch.SymInt):
        return 0
    for symbol in batch:
        ratio = size.node.expr / symbol
        if ratio.is_Integer and int(ratio) > 0:
            return int(ratio)
    return 0


def _argument(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _is_dropout_module(kind: Any) -> bool:
    """nn_module_stack names classes by their qualified name (or holds the class itself)."""
    name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
    return name.startswith("torch.nn.modules.dropout.") and name.rsplit(".", 1)[-1] in (
        "Dropout", "Dropout1d", "Dropout2d", "Dropout3d")


def rewrite(gm: fx.GraphModule, model_name: str) -> None:
    """Every random op of `gm` drawn by the rule, keyed as the eager forward keys it; the rest refused by name."""
    calls: dict[str, int] = {}
    batch = _batch_symbols(gm)

    def next_call(key: str) -> int:
        calls[key] = calls.get(key, -1) + 1
        return calls[key]

    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        key = (module_path(node) or [""])[-1]
        new: tuple[Any, tuple[Any, ...]]
        if node.target in _MODULE_DROPOUTS:
            x, p, train = node.args[:3]
            channels = _MODULE_DROPOUTS[node.target]
            kinds = module_types(node)
            if kinds and _is_dropout_module(kinds[-1]):  # an nn.Dropout module: its own rule (rows along dim 0)
                new = (randomness.graph_dropout, (x, p, train, key, next_call(key), channels, _layout(x, batch)))
            elif train and p:
                new = (random_calls.graph_dropout, (x, p, key, next_call(key), _layout(x, batch), channels))
            else:
                node.replace_all_uses_with(x)
                gm.graph.erase_node(node)
                continue
        elif node.target in _BERNOULLI:
            x = node.args[0]
            p = _argument(node, 1, "p", 0.5 if _BERNOULLI[node.target] else x)
            new = (random_calls.graph_bernoulli, (x, p, key, next_call(key), _layout(node, batch),
                                                  _BERNOULLI[node.target]))
        elif node.target is _ATTENTION and _argument(node, 4, "dropout_p", 0.0):
            q, k, v = node.args[:3]
            options = (_argument(node, 3, "attn_mask", None), _argument(node, 4, "dropout_p", 0.0),
                       _argument(node, 5, "is_causal", False), _argument(node, 6, "scale", None),
                       bool(node.kwargs.get("enable_gqa", False)))
            new = (random_calls.graph_attention, (q, k, v, *options, key, next_call(key), _layout(q, batch)))
        elif _op_name(node) in _REFUSED:
            raise _refused(node, model_name)
        else:
            continue
        with gm.graph.inserting_after(node):
            replacement = gm.graph.call_function(*new)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
    gm.recompile()


def _op_name(node: fx.Node) -> str:
    """An aten op's name without its overload (aten.random_.from -> random_)."""
    parts = str(node.target).split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "aten" else ""


def _refused(node: fx.Node, model_name: str) -> ParatrainError:
    where = ".".join(p for p in module_path(node)[-1:] if p) or "its forward"
    op = _op_name(node)
    return ParatrainError(
        f"{model_name}.{where} draws {op} while training; a pipeline stage would draw it from its own generator, so "
        "its numbers would follow the layout. A pipeline places dropout (a module or a function), bernoulli and "
        "attention dropout by paratrain's rule (docs/parallelism.md, Randomness): draw it with one of those, set its "
        "probability to 0, or use a data-parallel strategy")
