"""Mixed precision: autocast around the model's forward and, for fp16, a GradScaler.

Outputs are cast back to float32 so the loss (computed outside the model) is accumulated in full
precision, as Lightning Fabric and Accelerate do.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    if isinstance(value, tuple | list):
        return type(value)(_to_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_float32(v) for k, v in value.items()}
    return value


def apply_autocast(model: nn.Module, precision: str, device_type: str) -> nn.Module:
    if precision not in _DTYPES:
        return model
    dtype = _DTYPES[precision]
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return _to_float32(out)

    model.forward = autocast_forward  # type: ignore[method-assign]
    return model


def make_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    if precision != "16":
        return None
    return torch.amp.GradScaler(device_type)
