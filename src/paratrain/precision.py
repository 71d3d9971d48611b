"""Mixed precision: autocast around the model's forward and, for fp16, a GradScaler.

Outputs are cast back to float32 so the loss (computed outside the model) is accumulated in full
precision, as Lightning Fabric and Accelerate do.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from . import _forwards
from ._tree import map_tensors

_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def _as_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() and tensor.dtype != torch.float32 else tensor


def apply_autocast(model: nn.Module, precision: str, device_type: str) -> nn.Module:
    if precision not in _DTYPES:
        return model
    dtype = _DTYPES[precision]
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return map_tensors(_as_float32, out)

    _forwards.replace(model, autocast_forward, f"autocast {precision}")
    return model


def make_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    if precision != "16":
        return None
    return torch.amp.GradScaler(device_type)
