"""The CUDA-only part of single-process pipelining behind one small shim (torchgpipe's CPUStream idea).

On CUDA every device gets a copy stream: a micro-batch moves to the next stage's device there while
that device still computes the previous micro-batch, and the compute stream waits for the copy only
when it needs the data. On CPU the same calls are plain `.to()` and no-ops, so the code path that
CUDA runs is the one CPU tests exercise.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._tree import map_tensors


class Copier:
    def __init__(self, devices: list[torch.device]) -> None:
        self._streams: dict[torch.device, Any] = {}
        for device in devices:
            if device.type == "cuda" and device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)

    def to(self, value: Any, device: torch.device) -> Any:
        """`value` on `device`, copied asynchronously where the hardware allows."""
        return map_tensors(lambda t: self._copy(t, device), value)

    def _copy(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        if value.device == device:
            return value
        stream = self._streams.get(device)
        if stream is None or value.device.type != "cuda":
            return value.to(device, non_blocking=value.device.type == "cuda" or device.type == "cuda")
        stream.wait_stream(torch.cuda.current_stream(value.device))  # the producer has finished
        with torch.cuda.stream(stream):
            out = value.to(device, non_blocking=True)
        value.record_stream(stream)  # keep the source alive until the copy has read it
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)
        out.record_stream(compute)
        return out
