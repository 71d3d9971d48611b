"""Measure the GPUs at hand into a cluster spec (`--cluster local` where CUDA is available).

On a GPU the planner's layer times are measured on the device itself (`profile.measure` runs there), so what
the spec must add is what a profile cannot see: the device's peak matrix rate per precision and how a product's
size bounds it (for the analytic models), its memory and memory bandwidth, what the CUDA context and other
processes already hold, and paratrain's per-step cost. Links between GPUs are not measured: with one GPU there
is none, and with several the `h100-nvlink` preset's links are used and named as such in the description.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .cluster import PRESETS, Cluster, from_spec

DTYPES = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}
SIDES = (256, 512, 1024, 2048, 4096, 8192)


def _seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Best seconds per call of `fn` over `repeats` calls, after a warm-up, the device synchronised."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


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

        rates.append((2.0 * n**3, 2.0 * n**3 * batch / _seconds(products, device, repeats)))
    best = max(r for _, r in rates)
    return best, [[flops, round(rate / best, 4)] for flops, rate in rates]


def memory_bandwidth(device: torch.device, elements: int = 2**26) -> float:
    """Bytes/s a device-to-device copy moves, counting bytes read and written."""
    src = torch.ones(elements, device=device)
    dst = torch.empty_like(src)
    return 2 * elements * 4 / _seconds(lambda: dst.copy_(src), device, 5)


def framework_overhead(device: torch.device, repeats: int = 30) -> float:
    """Seconds a `run.forward_backward` + prepared optimizer step adds over the bare loop on `device` (tiny
    model, `single`): where the host runs ahead of the device this hides, and where kernels are small it shows."""
    import paratrain

    x, y, loss = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device), torch.nn.MSELoss()
    bare = torch.nn.Linear(8, 8).to(device)
    opt = torch.optim.SGD(bare.parameters(), lr=1e-3)

    def plain() -> None:
        loss(bare(x), y).backward()
        opt.step()
        opt.zero_grad()

    run = paratrain.setup(strategy="single", accelerator=device.type, timeout_s=60)
    try:
        net = torch.nn.Linear(8, 8)
        model, prepared = run.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3))

        def wrapped() -> None:
            run.forward_backward(model, x, y, loss)
            prepared.step()
            prepared.zero_grad()

        base = _seconds(plain, device, repeats)
        through = _seconds(wrapped, device, repeats)
    finally:
        run.close()
    return max(0.0, through - base)


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
        reserved=float(total - free), step_overhead=framework_overhead(device), measured_here=True,
    )
