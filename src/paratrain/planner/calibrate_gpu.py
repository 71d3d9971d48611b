"""Measure the GPUs at hand into a cluster spec (`--cluster local` where CUDA is available).

On a GPU the planner's layer times are measured on the device itself (`profile.measure` runs there), so what
the spec must add is what a profile cannot see: the device's peak matrix rate per precision and how a product's
size bounds it (for the analytic models), its memory and memory bandwidth, what the CUDA context and other
processes already hold, and paratrain's per-step cost. Links between GPUs are not measured: with one GPU there
is none, and with several the `h100-nvlink` preset's links are used and named as such in the description.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..measure.timing import best_seconds
from .calibrate import framework_overhead, memory_bandwidth
from .cluster import PRESETS, Cluster, from_spec

DTYPES = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}
SIDES = (256, 512, 1024, 2048, 4096, 8192)


def matmul_curve(device: torch.device, dtype: torch.dtype, sides: tuple[int, ...] = SIDES,
                 repeats: int = 5) -> tuple[float, list[list[float]]]:
    """(best FLOP/s, [[flops of one product, fraction of that best], ...]) of square products on `device`; each
    timed over enough products back to back that launch latency does not hide the small ones' rate."""
    rates = []
    for n in sides:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        batch = max(1, min(64, 8192**3 // n**3))

        def products(a: torch.Tensor = a, b: torch.Tensor = b, batch: int = batch) -> None:
            for _ in range(batch):
                torch.matmul(a, b)

        rates.append((2.0 * n**3, 2.0 * n**3 * batch / best_seconds(products, device, repeats)))
    best = max(r for _, r in rates)
    return best, [[flops, round(rate / best, 4)] for flops, rate in rates]


def measure(say: Callable[[str], None] = print) -> Cluster:
    """This machine's GPUs as a `Cluster`, measured now (about 10 s)."""
    device = torch.device("cuda", 0)
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(device)
    say(f"paratrain plan: measuring this machine's GPU ({count} x {props.name}: matrix products in fp32, bf16 and "
        "fp16, memory bandwidth, paratrain's step)")
    peaks, curves = {}, {}
    for precision, dtype in DTYPES.items():
        peaks[precision], curves[precision] = matmul_curve(device, dtype)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)  # what the CUDA context and other processes hold now
    links = from_spec(PRESETS["h100-nvlink"])
    between = "no links (one GPU)" if count == 1 else "links between GPUs from the h100-nvlink preset, not measured"
    return Cluster(
        name="local", kind="cuda", devices_per_node=count, nodes=1,
        description=f"this machine measured: {count} x {props.name}; {between}",
        peak_flops=peaks, memory=float(total), memory_bandwidth=memory_bandwidth(device),
        intra=links.intra, inter=links.inter,
        efficiency=tuple((x, y) for x, y in curves["bf16"]), overlap=1.0, process_bytes=0.0,
        reserved=float(total - free), step_overhead=framework_overhead(device, 30), measured_here=True,
    )
