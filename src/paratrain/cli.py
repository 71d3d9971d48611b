"""Command line: argument parsing only; every subcommand calls into its module."""

from __future__ import annotations

import argparse
import sys

from .errors import ParatrainError


def _run(ns: argparse.Namespace) -> int:
    from .launcher.checks import LaunchSpec, parse_nnodes
    from .launcher.cli_run import run

    low, high = parse_nnodes(ns.nnodes)
    spec = LaunchSpec(
        nproc=ns.nproc if ns.nproc is not None else _default_nproc(), min_nodes=low, max_nodes=high,
        node_rank=ns.node_rank, master_addr=ns.master_addr, master_port=ns.master_port,
        max_restarts=ns.max_restarts, backend=ns.backend, init=ns.init, connect_timeout=ns.connect_timeout,
        timeout=ns.timeout, run_id=ns.run_id,
    )
    return run(spec, ns.script, ns.args)


def _default_nproc() -> int:
    from .runtime import cuda_count

    return cuda_count() or 1


def _doctor(ns: argparse.Namespace) -> int:
    from .doctor import report

    return report(ns.master_port)


def _bench(ns: argparse.Namespace) -> int:
    from .bench.cli import main as bench_main

    return bench_main(ns)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain", description="Run and measure PyTorch training under any strategy.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="start workers on this machine (torchrun's elastic agent)")
    r.add_argument("--nproc", type=int, default=None, help="workers on this machine (default: GPUs, or 1 on CPU)")
    r.add_argument("--nnodes", default="1", help="machines: N or MIN:MAX for elastic runs")
    r.add_argument("--node-rank", type=int, default=0)
    r.add_argument("--master-addr", default="127.0.0.1")
    r.add_argument("--master-port", type=int, default=None, help="default: a free port (single machine)")
    r.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to K times on failure")
    r.add_argument("--backend", default=None, choices=["gloo", "nccl"])
    r.add_argument("--init", default=None, help="process-group init for workers, e.g. file:///shared/path")
    r.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the master")
    r.add_argument("--timeout", type=float, default=None, help="seconds a collective may wait (default 600)")
    r.add_argument("--run-id", default="paratrain", help="the same on every node of one job")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(func=_run)

    d = sub.add_parser("doctor", help="report devices, backends and launch environment; exit 1 on problems")
    d.add_argument("--master-port", type=int, default=29500)
    d.set_defaults(func=_doctor)

    from .bench.cli import add_arguments

    b = sub.add_parser("bench", help="measure every strategy on a workload and write results.json and plots")
    add_arguments(b)
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except ParatrainError as exc:
        print(f"paratrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
