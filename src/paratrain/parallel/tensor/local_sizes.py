"""A sharded block's own size attributes, set to this rank's share.

Megatron and vLLM build attention with `num_heads = total_heads // tp`; a model written for one device reads the
whole count from an attribute: OPT's `view(bsz, -1, self.num_heads, self.head_dim)` (which runs on half the
features and silently pairs the wrong values into heads), GPT-2's `split(self.split_size)` of its fused
projection, T5's zero position bias of `self.n_heads` heads. Setting those attributes to the rank's share makes
such a block compute exactly its heads. Which attributes: integer attributes with one of the usual size names
that the block's methods read (`self.<name>`), and whose value the tensor degree divides. Whether it is right
for a given block is not guessed: the check (`check.choose`) runs the block both ways on the example batch and
keeps the way that equals the whole block.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

SIZE_NAMES = frozenset({
    "num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "n_local_heads",
    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_kv_head",
    "embed_dim", "inner_dim", "split_size", "all_head_size", "hidden_size", "n_embd", "d_inner",
})
"""Attribute names that hold a head count or a width made of heads, in the libraries' attention code."""


def _read_by_forward(module: nn.Module) -> set[str] | None:
    """Names the class's methods read as `self.<name>` (its forward and the helpers it calls: OpenAI GPT splits
    heads in `split_heads`); None: no source to read, so any may be."""
    try:
        source = inspect.getsource(type(module))
    except (OSError, TypeError):
        return None
    return set(re.findall(r"self\.(\w+)", source))


def sizes(module: nn.Module, tp: int) -> dict[str, tuple[int, int]]:
    """{attribute: (whole, this rank's share)} of the size attributes `scale` would set on `module`."""
    read = _read_by_forward(module)
    found = {}
    for name, value in vars(module).items():
        if name not in SIZE_NAMES or type(value) is not int or value < tp or value % tp:
            continue
        if read is not None and name not in read:
            continue
        found[name] = (value, value // tp)
    return found


def scale(module: nn.Module, found: dict[str, tuple[int, int]]) -> None:
    for name, (_, share) in found.items():
        setattr(module, name, share)


def describe(kind: str, found: dict[str, tuple[int, int]]) -> str:
    return f"{kind} reads " + ", ".join(f"{n} {whole} -> {share}" for n, (whole, share) in found.items())
