"""Measure the machine at hand into a cluster spec (`--cluster local`).

Two CPU workers (one thread each, as `paratrain run` starts them) time every collective the strategies use
(all-reduce, all-gather, reduce-scatter, gloo's `all_to_all_single` as expert parallelism exchanges rows, and
send/recv) over message sizes from 4 KiB to 16 MiB, with gloo on loopback; alpha and beta are fitted per
collective (`comm.fit`). The same workers time a two-stage pipeline of tiny layers, whose step is almost all
schedule overhead (sends, receives, Python), a tensor-parallel pair of tiny Linears against the same pair whole
(DTensor's per-call cost), one listed expert's exchange as expert parallelism runs it against its collectives
alone (the runtime's cost per exchange), and chains of FSDP2 units of two sizes against the same chains whole,
less their collectives timed alone (FSDP's per-unit cost on CPU workers), and report their resident memory once
torch's dense kernels have run (code and math-library workspaces resident, no model): the floor every worker's
measured peak includes. One core times matrix products of growing size for its peak rate and efficiency curve,
and a large copy for its memory bandwidth; one process times paratrain's loop against the bare one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..measure.timing import best_seconds
from ..memstats import resident_bytes
from .cluster import GIB, Cluster, Link
from .comm import COLLECTIVES, fit

SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB
_PIPE_MICROBATCHES = 8


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _collective(kind: str, n: int) -> Callable[[], Any]:
    import torch.distributed as dist

    p, rank = dist.get_world_size(), dist.get_rank()
    elements = max(p, n // 4 // p * p)
    full, shard = torch.ones(elements), torch.ones(elements // p)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    if kind == "all_to_all":  # n bytes sent by each worker, 1/p of them to each (itself included)
        received = torch.empty_like(full)
        return lambda: dist.all_to_all_single(received, full)

    def ping_pong() -> None:  # rank 0 <-> rank 1; one-way time is half the round trip
        if rank == 0:
            dist.send(full, 1)
            dist.recv(full, 1)
        elif rank == 1:
            dist.recv(full, 0)
            dist.send(full, 0)

    return ping_pong


def _pipeline_step(repeats: int) -> float:
    """Seconds per step of a 2-stage GPipe pipeline of tiny layers (run in the workers)."""
    import contextlib
    import io

    import paratrain

    run = paratrain.setup(strategy="pp", microbatches=_PIPE_MICROBATCHES, schedule="gpipe", balance="equal",
                          timeout_s=120)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x, y = torch.randn(8 * _PIPE_MICROBATCHES, 8), torch.randn(8 * _PIPE_MICROBATCHES, 8)
    loss = torch.nn.MSELoss()
    with contextlib.redirect_stdout(io.StringIO()):  # the pipeline's own report of its split and memory
        model = run.prepare(model)
        run.forward_backward(model, x, y, loss)
    return _timed(lambda: run.forward_backward(model, x, y, loss), repeats)


def _tensor_parallel_overhead(mesh: Any, repeats: int) -> float:
    """Seconds one DTensor Linear adds per forward and backward over the plain Linear, beyond its all-reduce: a
    column/row pair of tiny Linears, timed sharded over the workers and whole, less the pair's two all-reduces."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def pair() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))

    plain = pair()
    sharded = parallelize_module(pair(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(8, 8)
    small = torch.ones(64)
    whole = _timed(lambda: plain(x).sum().backward(), repeats)
    split = _timed(lambda: sharded(x).sum().backward(), repeats)
    reduce = _timed(lambda: dist.all_reduce(small), repeats)
    return max(0.0, (split - whole - 2 * reduce) / 2)


def _expert_overhead(repeats: int) -> float:
    """Seconds one listed expert's call under expert parallelism adds beyond its collectives: the runtime's own
    exchange (`parallel.expert.dispatch`: row counts agreed, rows to the owner and back through the differentiable
    all-to-all, then the backward's two), on 4 rows of 8 features, less those five collectives timed plain."""
    import torch.distributed as dist

    from ..parallel.expert import dispatch

    group, p, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    x = torch.randn(4, 8, requires_grad=True)

    def call() -> None:
        rows = dispatch.agree(0, 4, group, p, "calibration")
        to_owner = [4 if r == 0 else 0 for r in range(p)]
        mine = rows if rank == 0 else [0] * p
        back = dispatch.exchange(2 * dispatch.exchange(x, to_owner, mine, group), mine, to_owner, group)
        back.sum().backward()

    whole = _timed(call, 4 * repeats)
    small, received = torch.ones(8 * p), torch.empty(8 * p)
    a2a = _timed(lambda: dist.all_to_all_single(received, small), 4 * repeats)
    gather = _timed(lambda: dist.all_gather_into_tensor(received[: 2 * p], small[:2]), 4 * repeats)
    return max(0.0, whole - 4 * a2a - gather)


FSDP_WIDTHS = (128, 512)
_FSDP_UNITS, _FSDP_BATCH = 4, 256


def _fsdp_unit_cost(width: int, mesh: Any, repeats: int) -> tuple[float, float]:
    """(unit parameter bytes, seconds) one FSDP2 unit of `width` features adds to a forward and backward beyond
    its math and its collectives (two all-gathers and one reduce-scatter, timed alone here): Python hooks, the
    copies into and out of the flat buffers, and the CPU the transfers take from compute beside them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def chain() -> torch.nn.Sequential:
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(_FSDP_UNITS)])

    plain, sharded = chain(), chain()
    for unit in sharded.children():
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(_FSDP_BATCH, width)
    whole = _timed(lambda: plain(x).sum().backward(), repeats)
    split = _timed(lambda: sharded(x).sum().backward(), repeats)
    p = dist.get_world_size()
    elements = (width * width + width) // p * p
    full, shard = torch.ones(elements), torch.ones(elements // p)
    gather = _timed(lambda: dist.all_gather_into_tensor(full, shard), repeats)
    scatter = _timed(lambda: dist.reduce_scatter_tensor(shard, full), repeats)
    comm = _FSDP_UNITS * (2 * gather + scatter)
    return 4.0 * (width * width + width), max(0.0, (split - whole - comm) / _FSDP_UNITS)


def _warm_dense_kernels() -> None:
    """One small training step of a dense layer: the math library's code and workspaces become resident, as
    in every worker that trains, so the floor measured after it is the floor a real worker starts from."""
    layer = torch.nn.Linear(512, 512)
    opt = torch.optim.Adam(layer.parameters())
    torch.nn.functional.mse_loss(layer(torch.randn(256, 512)), torch.randn(256, 512)).backward()
    opt.step()


def worker(sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Runs in each of the calibration workers; rank 0's answer is the measurement."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..collectives import max_over_world

    pipeline = _pipeline_step(repeats)  # starts the process group through paratrain.setup
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # what the tensor-parallel and FSDP probes shard over
    tensor = max_over_world(_tensor_parallel_overhead(mesh, 4 * repeats))
    expert = max_over_world(_expert_overhead(repeats))
    fsdp = [(n, max_over_world(t)) for n, t in (_fsdp_unit_cost(w, mesh, repeats) for w in FSDP_WIDTHS)]
    _warm_dense_kernels()
    resident = resident_bytes()
    sweep: dict[str, list[tuple[int, float]]] = {}
    for kind in COLLECTIVES:
        points = []
        for n in sizes:
            dist.barrier()
            seconds = _timed(_collective(kind, n), repeats)
            if kind == "p2p":
                seconds /= 2
            points.append((n, max_over_world(seconds)))
        sweep[kind] = points
    return {"sweep": sweep, "pipeline_step_s": max_over_world(pipeline), "tp_overhead_s": tensor, "fsdp_unit": fsdp,
            "expert_overhead_s": expert,
            "resident_bytes": resident,
            "world": dist.get_world_size()}


def _matmul_curve(repeats: int = 3) -> tuple[float, list[list[float]]]:
    """(best FLOP/s of one thread, [[flops of one product, fraction of that best], ...])."""
    rates = []
    with _threads(1):
        for n in (32, 64, 128, 256, 512, 1024):
            a, b = torch.randn(n, n), torch.randn(n, n)
            product = functools.partial(torch.matmul, a, b)
            seconds = min(_timed(product, 1) for _ in range(repeats))
            rates.append((2.0 * n**3, 2.0 * n**3 / seconds))
    best = max(r for _, r in rates)
    return best, [[flops, round(rate / best, 4)] for flops, rate in rates]


def framework_overhead(device: torch.device, repeats: int = 20) -> float:
    """Seconds a `run.forward_backward` + prepared optimizer step adds over the bare loop on `device` (tiny
    model, one process, `single`): the hooks and wrappers every strategy's step goes through. Where a GPU's host
    runs ahead of the device this hides, and where kernels are small it shows."""
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

        base = best_seconds(plain, device, repeats)
        through = best_seconds(wrapped, device, repeats)
    finally:
        run.close()
    return max(0.0, through - base)


def memory_bandwidth(device: torch.device, elements: int = 2**26, repeats: int = 5) -> float:
    """Bytes/s a copy within the device's memory moves, counting bytes read and written."""
    src = torch.ones(elements, device=device)
    dst = torch.empty_like(src)
    return 2 * elements * 4 / best_seconds(lambda: dst.copy_(src), device, repeats)


class _threads:
    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.before)


def _cpu(probe: Callable[..., float], *args: Any) -> float:
    """A device probe run on one CPU thread, as every CPU worker computes."""
    with _threads(1):
        return probe(torch.device("cpu"), *args)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds, seconds per byte) through two measured (bytes, seconds) points, both kept non-negative."""
    (x0, y0), (x1, y1) = points
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    return max(0.0, y0 - slope * x0), slope


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * GIB


def measure(timeout: float = 300.0, repeats: int = 5, sizes: tuple[int, ...] = SIZES,
            say: Callable[[str], None] = print) -> Cluster:
    """This machine as a `Cluster` of CPU workers, measured now (about 10-30 s)."""
    from ..launcher.spawn import launch

    say(f"paratrain plan: measuring this machine (2 gloo workers, {len(sizes)} message sizes per collective)")
    found = launch(worker, sizes, repeats, nproc=2, timeout=timeout, accelerator="cpu", prefix_output=False)
    p = int(found["world"])
    collectives = {kind: fit(kind, p, points) for kind, points in found["sweep"].items()}
    p2p_alpha, p2p_beta = collectives["p2p"]
    peak, curve = _matmul_curve()
    cores = usable_cores()
    # A 2-stage GPipe step is 2M + 2 action slots long on its critical path, each slot also paying one send.
    slots = 2 * _PIPE_MICROBATCHES + 2
    action = max(0.0, found["pipeline_step_s"] / slots - p2p_alpha)
    loopback = Link(bandwidth=1.0 / max(p2p_beta, 1e-12), latency=p2p_alpha)
    return Cluster(
        name="local", kind="cpu", devices_per_node=cores, nodes=1,
        description=f"this machine measured: {cores} CPU worker(s), one thread each, gloo over loopback",
        peak_flops={"32": peak, "bf16": peak, "16": peak}, memory=total_memory() / cores,
        memory_bandwidth=_cpu(memory_bandwidth, 2**24, 3), intra=loopback, inter=loopback,
        efficiency=tuple((x, y) for x, y in curve),
        overlap=0.0, process_bytes=float(found["resident_bytes"]), reserved=0.0, action_overhead=action,
        step_overhead=_cpu(framework_overhead), tp_overhead=float(found["tp_overhead_s"]),
        expert_overhead=float(found["expert_overhead_s"]),
        fsdp_unit=_line(found["fsdp_unit"]),
        collectives=collectives, measured_here=True,
    )
