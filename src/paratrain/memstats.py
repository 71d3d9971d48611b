"""How much memory this process uses, the way benchmarks and the planner's validation read it.

CUDA devices report the allocator's peak (what tensors took; the context is not counted). CPU workers
report the resident set of the process from /proc (Linux): its peak (VmHWM), which can be reset to the
current size, so a timed block's peak is not a warm-up's.
"""

from __future__ import annotations

import torch


def _status(key: str) -> float:
    """A /proc/self/status field in bytes (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 0.0


def resident_bytes() -> float:
    return _status("VmRSS")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak resident set size (VmHWM) of this process (Linux)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_bytes(device: torch.device) -> float:
    """Peak since the last `reset_peak`: allocated bytes on CUDA, resident bytes of the process on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return _status("VmHWM")


def give_back_freed() -> None:
    """Hand the C allocator's freed memory back to the system (glibc's `malloc_trim`; nothing elsewhere).

    Building, loading, exporting and checkpointing a sharded model allocate and free many blocks of a few MB (a
    parameter's piece, a read slice), which glibc keeps in its heap after they are freed: a rank's resident set
    after `prepare` stayed up to 0.4 GB above what it held, and every later phase's peak started there. Called
    after those phases, so the next starts from what the rank holds."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)
