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
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _mask(shape: torch.Size, p: float, seed: int, step: int, layer: str, call: int) -> torch.Tensor:
    base = int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{layer}/{call}".encode(), digest_size=4).digest(), "little")
    rows, per_row = shape[0], int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
    row = torch.arange(rows, dtype=torch.int64).view(rows, 1)
    col = torch.arange(per_row, dtype=torch.int64).view(1, per_row)
    bits = _mix(_mix(col ^ base) ^ ((row * 0x9E3779B1) & _MASK))
    return (bits >= int(p * 2**32)).view(shape)


class _RuleDropout:
    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name
        self.seed = self.step = self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not m.training or m.p == 0.0:
            return x
        channels = isinstance(m, nn.Dropout1d | nn.Dropout2d | nn.Dropout3d)
        shape = x.shape[:2] if channels else x.shape
        keep = _mask(shape, m.p, self.seed, self.step, self.name, self.calls).to(x.device)
        self.calls += 1
        if channels:
            keep = keep.view(*shape, *([1] * (x.dim() - 2)))
        return x * (keep.to(x.dtype) / (1.0 - m.p))


def layout_rule(model: nn.Module, seed: int, step: int) -> None:
    """The reference's `dropout=` rule: nn.Dropout modules draw the documented masks for `step`."""
    for name, module in model.named_modules():
        if type(module) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
            rule = module.__dict__.get("forward")
            if not isinstance(rule, _RuleDropout):
                rule = _RuleDropout(module, name)
                module.forward = rule  # type: ignore[method-assign]
            rule.seed, rule.step, rule.calls = seed, step, 0


def applies_to(model: Any) -> bool:
    return any(type(m) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d) and m.p > 0 for m in model.modules())
