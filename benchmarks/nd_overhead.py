"""paratrain's N-D layouts against the same layouts written by hand (torchtitan's order), step by step.

`paratrain bench` alternates the two sides in blocks of steps; on this 2-core machine, with 2 or 4 workers, the
medians of two such runs of the same code move by 5-10%, more than the 2% the comparison is about. Here both
sides are built in the same workers (the bench's own builders: `worker.paratrain_side` and
`references.BUILDERS`), and every step alternates A B B A, each step timed alone by the bench's harness
(`measure.timing.time_steps`: a barrier first, the slowest rank's time), so the machine's drift falls on both
sides within a second. Reported per layout: each side's median step, the ratio of the medians, and
the median of the paired ratios (each paratrain step over the reference step beside it), each with its 95%
bootstrap interval and the verdict `paratrain bench` prints (`paratrain.measure.stats`).

Expert and context parallelism run on workloads of their own (`WORKLOAD`): `ep` on `gpt-moe` (8 listed experts,
top-2, per block) beside `torch-ep`, `cp` on `gpt-long` (1,024 tokens a sequence) beside `torch-cp`
(`bench/references_ep_cp.py`); `ep:2:mixtral` times Hugging Face Mixtral's grouped experts (a tiny config, 8
experts, top-2, on gpt-moe's batches) beside the same `torch-ep`.

    python benchmarks/nd_overhead.py benchmarks/results/nd-overhead.json            # the gpt workload, mini
    python benchmarks/nd_overhead.py OUT --layouts ep:2,cp:2,ep:2:mixtral             # STRATEGY:WORKERS[:WORKLOAD]
    python benchmarks/nd_overhead.py OUT --layouts cp:2:loss=token_mean               # ... and setup options
    python benchmarks/nd_overhead.py OUT --steps 10 --size tiny                        # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

import paratrain
from paratrain.measure import stats

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _emit import emit  # noqa: E402

LAYOUTS = (("fsdp", 2), ("tp", 2), ("fsdp+tp", 4), ("tp+pp", 4), ("ddp+pp", 4), ("fsdp+pp", 4))
"""(strategy, workers): the layouts of the N-D issue's benchmark, at the fewest workers each runs on (the default)."""
WORKLOAD = {"ep": "gpt-moe", "cp": "gpt-long"}
"""The workload of a layout that needs one of its own (experts to share out, long sequences); the others time gpt."""


class _Logits(torch.nn.Module):
    """A Hugging Face causal LM as a module from token ids to logits, as the workloads' models are."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits  # type: ignore[no-any-return]


def _workload(name: str, size: str) -> Any:
    """A workload by name; `mixtral`: Hugging Face Mixtral at width 128 (2 layers, 8 grouped experts, top-2, its
    defaults otherwise) on the token batches of gpt-moe at `size`."""
    from dataclasses import replace

    from paratrain.measure import workloads

    if name != "mixtral":
        return workloads.get(name, gpt_size=size)
    import transformers as tf

    tf.logging.set_verbosity_error()
    batches = workloads.get("gpt-moe", gpt_size=size)
    config = tf.MixtralConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=batches.tokens,
                              num_local_experts=8, num_experts_per_tok=2)
    return replace(batches, name="mixtral", model=lambda: _Logits(tf.MixtralForCausalLM(config)))


def _pair(strategy: str, workers: int, workload: str, size: str, steps: int, microbatches: int,
          options: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    """In each worker: both sides built, warmed up, then `steps` alternated steps each (the slowest rank's times)."""
    import torch.distributed as dist

    from paratrain.bench import jobs, references, worker
    from paratrain.measure.timing import time_steps

    settings = jobs.Settings(workload=workload, gpt_size=size, batch=8, steps=1, warmup=0, repeat=1, schedule="1f1b")
    worker._init_group(jobs.Job(workers, (), strategy), settings)
    w = _workload(workload, size)
    pipelined = "pp" in strategy.split("+")
    ref = jobs.REFERENCE[strategy]
    m, schedule = (microbatches, "1f1b") if pipelined else (None, None)
    ours = worker.paratrain_side(jobs.Spec(strategy, workers, m, schedule, options=options), w, w.data(8), settings)
    theirs = references.BUILDERS[ref](jobs.Spec(ref, workers, m, schedule), w, w.data(8), settings,
                                      torch.device("cpu"))
    for _ in range(3):
        ours()
        theirs()
    times: dict[str, list[float]] = {"paratrain": [], "hand-written": []}
    cpu = torch.device("cpu")
    for i in range(steps):
        order = (("paratrain", ours), ("hand-written", theirs))
        for name, step in order if i % 2 == 0 else order[::-1]:
            times[name] += time_steps(step, 1, [cpu], cpu)[0]
    dist.barrier()
    return {"reference": ref, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--size", default="mini", help="size of the gpt workload")
    parser.add_argument("--moe-size", default="moe", help="size of gpt-moe (ep)")
    parser.add_argument("--long-size", default="long", help="size of gpt-long (cp)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(f"{s}:{w}" for s, w in LAYOUTS))
    args = parser.parse_args()
    sys.argv = [sys.argv[0], *([args.out] if args.out else [])]  # _emit reads the output path from argv
    sizes = {"gpt": args.size, "gpt-moe": args.moe_size, "gpt-long": args.long_size, "mixtral": args.moe_size}
    rows = []
    for item in args.layouts.split(","):
        strategy, workers, *rest = item.split(":")
        options = tuple(tuple(x.split("=", 1)) for x in rest if "=" in x)  # setup options: loss=token_mean
        named = [x for x in rest if "=" not in x]
        workload = named[0] if named else WORKLOAD.get(strategy, "gpt")
        got = paratrain.launch(_pair, strategy, int(workers), workload, sizes[workload], args.steps,
                               args.microbatches, options, nproc=int(workers), timeout=900, accelerator="cpu")
        ours, theirs = got["times"]["paratrain"], got["times"]["hand-written"]
        of_medians = stats.ratio_of_medians(ours, theirs, paired=True)  # the steps resampled in their pairs
        paired = stats.paired_ratio(ours, theirs)
        row = {"strategy": strategy, "options": dict(options), "workers": int(workers),
               "workload": f"{workload} {sizes[workload]}",
               "reference": got["reference"],
               "paratrain_median_s": statistics.median(ours), "reference_median_s": statistics.median(theirs),
               "ratio_of_medians": of_medians.value, "median_paired_ratio": paired.value,
               "ratio_ci95": of_medians.interval, "paired_ci95": paired.interval, "verdict": stats.verdict(paired),
               "steps": len(ours), "paratrain_s": ours, "reference_s": theirs}
        rows.append(row)
        print(f"{strategy:>8} x{workers} {dict(options) or ''}: paratrain {row['paratrain_median_s']:.4f} s, "
              f"{row['reference']} "
              f"{row['reference_median_s']:.4f} s, ratio of medians {of_medians.text()}; paired: {row['verdict']}",
              file=sys.stderr, flush=True)
    timed = ", ".join(dict.fromkeys(row["workload"] for row in rows))
    emit({"workload": f"{timed}, global batch 8, SGD", "microbatches": args.microbatches,
          "schedule": "1f1b", "torch": torch.__version__, "cores": os.cpu_count(), "load_average": os.getloadavg(),
          "layouts": rows})


if __name__ == "__main__":
    main()
