"""schedule="auto" against a full sweep: how close its pick is to the best (schedule, micro-batch count) and
what fraction of the sweep's time it spends. Goal: within 5% of the sweep's best in at most 1/3 of its time.

On 2 CPU workers, the `mlp` workload (8 x Linear(512, 512), global batch 2048) as `pp` with one stage per
worker; the schedules are the ones schedule="auto" chooses among for that layout (1f1b, zero-bubble, gpipe)
and the counts those that give micro-batches of at least 32 rows. Rounds alternate sweep and search on the
same pipeline, each measurement being the slowest rank's fastest of 3 trial steps.

Usage: OMP_NUM_THREADS=1 python benchmarks/schedule_search.py [OUT.json]
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from _emit import emit  # benchmarks/ is the script's folder, first on sys.path

import paratrain
from paratrain.measure import workloads

ROUNDS = int(os.environ.get("SCHEDULE_SEARCH_ROUNDS", "2"))  # bench_limits.sh --quick runs 1


def _compare() -> dict[str, Any]:
    from paratrain.parallel.pipeline.schedules import auto_names
    from paratrain.parallel.pipeline.tuning import tune_schedule
    from paratrain.parallel.plan import Plan
    from paratrain.parallel.trial import no_trace

    torch.set_num_threads(1)
    workload = workloads.get("mlp")
    run = paratrain.setup(strategy="pp", schedule="1f1b", microbatches=2, seed=0, accelerator="cpu")
    x, y = workload.data(workload.batch)
    model = run.prepare(workload.model(), example=x)
    loss_fn = workload.loss()
    run.forward_backward(model, x, y, loss_fn)  # warm up
    names = auto_names(1)

    def candidates(name: str) -> list[int]:
        return [m for m in model.candidates(workload.batch, name) if m <= workload.batch // 32]

    def measure(name: str, m: int) -> float:
        return model.measure(x, y, m, schedule=name)

    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        with no_trace(model.local):
            sweep = {f"{n} M={m}": measure(n, m) for n in names for m in candidates(n)}
        sweep_s = time.perf_counter() - start
        plan = Plan(strategy="pp", stages=2, microbatches="auto", verbose=False)
        start = time.perf_counter()
        schedule, best = tune_schedule(plan, names, measure, candidates, model.num_stages, model.local)
        search_s = time.perf_counter() - start
        best_key = min(sweep, key=sweep.__getitem__)
        rounds.append({"sweep": sweep, "sweep_s": sweep_s, "sweep_best": best_key,
                       "search": plan.schedule_curve, "search_s": search_s, "search_pick": f"{schedule} M={best}",
                       "distance_from_best": sweep[f"{schedule} M={best}"] / sweep[best_key] - 1,
                       "time_fraction": search_s / sweep_s})
    return {"rounds": rounds}


def main() -> None:
    res = paratrain.launch(_compare, nproc=2, timeout=900)
    res["worst_distance_from_best"] = max(r["distance_from_best"] for r in res["rounds"])
    res["worst_time_fraction"] = max(r["time_fraction"] for r in res["rounds"])
    res["goal"] = "within 5% of the sweep's best in at most 1/3 of its time"
    res["goal_met"] = res["worst_distance_from_best"] <= 0.05 and res["worst_time_fraction"] <= 1 / 3
    emit(res)


if __name__ == "__main__":
    main()
