"""Command line: argument parsing only; every subcommand calls into its module."""

from __future__ import annotations

import argparse
import sys

from .errors import ParatrainError
from .runtime import DEFAULT_NPROC_TEXT


def _run(ns: argparse.Namespace) -> int:
    from .launcher import cluster
    from .launcher.checks import LaunchSpec
    from .launcher.cli_run import run
    from .runtime import default_nproc, read_slurm, torchrun_variables

    # the GPU count (torch's) only when no --nproc says how many: bad input is refused before torch loads
    nproc = ns.nproc if ns.nproc is not None else default_nproc()
    spec = LaunchSpec(nproc=nproc, backend=ns.backend, init=ns.init, connect_timeout=ns.connect_timeout,
                      timeout=ns.timeout, replica_groups=ns.replica_groups or 0, replica_group=ns.replica_group,
                      lighthouse=ns.lighthouse)
    typed = cluster.NodeFlags(nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                              master_port=ns.master_port, run_id=ns.run_id, max_restarts=ns.max_restarts)
    spec = cluster.resolve(spec, typed, cluster.from_torchrun(torchrun_variables()), read_slurm())
    return run(spec, ns.script, ns.args, dry_run=ns.dry_run)


def _lighthouse(ns: argparse.Namespace) -> int:
    from .launcher.lighthouse import serve

    return serve(ns.host, ns.port, min_groups=ns.min_groups, heartbeat_timeout_s=ns.heartbeat_timeout,
                 join_timeout_s=ns.join_timeout)


def _doctor(ns: argparse.Namespace) -> int:
    from .doctor import report

    return report(ns.master_port)


def _bench(ns: argparse.Namespace) -> int:
    from .bench.cli import main as bench_main

    if ns.plan:
        from .bench_plan import make_plan

        return bench_main(ns, planner=make_plan)
    return bench_main(ns)


def _plan(ns: argparse.Namespace) -> int:
    from .planner.command import PlanRequest, main

    request = PlanRequest(
        workload=ns.model or ns.workload, global_batch=ns.global_batch, cluster=ns.cluster, devices=ns.devices,
        precision=ns.precision, gpt_size=ns.gpt_size,
        optimizer=ns.optimizer, top=ns.top, out=ns.out, validate=ns.validate,
        **({"strategies": tuple(s.strip() for s in ns.strategies.split(",") if s.strip())} if ns.strategies else {}),
        steps=ns.steps,
        warmup=ns.warmup, repeat=ns.repeat, passes=ns.passes, timeout_s=ns.timeout,
        layouts=[s.strip() for s in ns.layouts.split(";") if s.strip()] if ns.layouts else [],
        command="paratrain " + " ".join(sys.argv[1:]),
    )
    return main(request)


def _plan_parser(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--workload", default="mlp",
                       help="a bench workload measured here (toy, mlp, convnet, resnet50, gpt, gpt-moe, gpt-long) "
                            "or an analytic GPT "
                            "(gpt-1.7b, gpt-3.6b, gpt-5b, gpt-7.5b)")
    which.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                       help="your model: factory(batch_size) -> (model, inputs, targets[, loss_fn])")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default: the workload's)")
    p.add_argument("--gpt-size", default=None,
                   help="size of the gpt, gpt-moe and gpt-long workloads (tiny, mini, moe, long, tiny-moe, tiny-long)")
    p.add_argument("--cluster", default="local",
                   help="local (this machine, measured), h100-nvlink, h100-ib, or a YAML/JSON spec file")
    p.add_argument("--devices", type=int, default=None, help="plan for this many of the cluster's devices")
    p.add_argument("--precision", default="32", choices=["32", "bf16", "16"])
    p.add_argument("--optimizer", default="adam", choices=["adam", "momentum", "sgd"])
    p.add_argument("--strategies", default=None,
                   help="strategies to consider, comma-separated (default: every one the planner predicts)")
    p.add_argument("--top", type=int, default=10, help="layouts to show (all go to plan.json)")
    p.add_argument("--out", default=None, help="directory for plan.json, the scaling plot and validation.json")
    p.add_argument("--validate", action="store_true",
                   help="also run every layout this machine holds and print predicted vs measured")
    p.add_argument("--layouts", default=None, help="--validate only these layouts, ';'-separated labels")
    p.add_argument("--steps", type=int, default=5, help="--validate: timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="--validate: untimed steps first")
    p.add_argument("--repeat", type=int, default=2, help="--validate: timed blocks per layout and pass")
    p.add_argument("--passes", type=int, default=1,
                   help="--validate: times each layout is measured, every other pass in reverse order (2: the "
                        "measurement compared with itself, about twice the time)")
    p.add_argument("--timeout", type=float, default=600.0, help="--validate: seconds one layout may take")
    p.set_defaults(func=_plan)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain", description="Run and measure PyTorch training under any strategy.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="start workers on this machine (torchrun's elastic agent)",
                       description="A flag not given is taken from torchrun's variable for it (PET_NNODES, "
                       "PET_NODE_RANK, PET_MASTER_ADDR, ...), else, inside a Slurm job step (srun), from the step: "
                       "nodes, rendezvous host (its first node), port and run id.")
    r.add_argument("--nproc", type=int, default=None, help=f"workers on this machine (default: {DEFAULT_NPROC_TEXT})")
    r.add_argument("--nnodes", default=None, help="machines: N or MIN:MAX for elastic runs (default 1, or Slurm's)")
    r.add_argument("--node-rank", type=int, default=None, help="0 on the machine that hosts the rendezvous")
    r.add_argument("--master-addr", default=None, help="rendezvous host (default 127.0.0.1, or Slurm's first node)")
    r.add_argument("--master-port", type=int, default=None,
                   help="default: a free port on one machine, or one derived from the Slurm job")
    r.add_argument("--max-restarts", type=int, default=None, help="restart all workers up to K times on failure")
    r.add_argument("--backend", default=None, choices=["gloo", "nccl"])
    r.add_argument("--init", default=None, help="process-group init for workers, e.g. file:///shared/path")
    r.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the master")
    r.add_argument("--timeout", type=float, default=None, help="seconds a collective may wait (default 600)")
    r.add_argument("--run-id", default=None, help="the same on every node of one job (default: from Slurm's job)")
    r.add_argument("--replica-groups", type=int, default=None, metavar="R",
                   help="R copies of the job averaging gradients through a torchft lighthouse; a failed group "
                        "restarts and rejoins from a live one (needs paratrain[ft])")
    r.add_argument("--replica-group", type=int, default=None, metavar="I",
                   help="start only group I of --replica-groups here (a cluster: one launcher per group)")
    r.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                   help="the lighthouse of --replica-group (`paratrain lighthouse`); one machine: started for you")
    r.add_argument("--dry-run", action="store_true",
                   help="print the torch.distributed.run command and environment it would start, and exit")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(func=_run)

    from .launcher.lighthouse import HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S

    lh = sub.add_parser("lighthouse", help="serve the torchft lighthouse that replica groups of a cluster job share")
    lh.add_argument("--port", type=int, default=29510, help="port to listen on (0: a free one, printed)")
    lh.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    lh.add_argument("--min-groups", type=int, default=1, help="groups a step needs (default 1: any survivor trains)")
    lh.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                    help="seconds of silence after which a group is left out of the next step")
    lh.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S,
                    help="seconds a step waits for a live group that has not asked yet (one still starting)")
    lh.set_defaults(func=_lighthouse)

    d = sub.add_parser("doctor", help="report devices, backends and launch environment; exit 1 on problems")
    d.add_argument("--master-port", type=int, default=29500)
    d.set_defaults(func=_doctor)

    from .bench.cli import add_arguments

    b = sub.add_parser("bench", help="measure every strategy on a workload and write results.json and plots")
    add_arguments(b)
    b.set_defaults(func=_bench)

    _plan_parser(sub.add_parser("plan", help="predict every layout's step time and memory; --validate measures them"))
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
