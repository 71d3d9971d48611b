"""What `setup(compile=True)` buys on this machine: the `gpt` workload's step time eager against compiled.

One process (`single`), the bench's GPT (`mini` by default: 4 blocks of 256, 128 tokens, batch 8), AdamW; the two
sides are built once, warmed up (the compile happens there and is timed apart), then timed in alternating
blocks A B A B so the machine's drift falls on both. Medians of the blocks' per-step times.

    python benchmarks/compile_cpu.py                    # writes benchmarks/results/compile-cpu.json
    python benchmarks/compile_cpu.py --size tiny --blocks 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import paratrain
from paratrain.measure import gpt


def build(cfg: gpt.GPTConfig, compile_option: bool | str, batch: int) -> dict[str, Any]:
    run = paratrain.setup(strategy="single", seed=0, compile=compile_option, accelerator="cpu")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = run.prepare(model, optimizer)
    x, y = gpt.tokens(batch, cfg)
    loss_fn = gpt.NextTokenLoss()

    def step() -> float:
        loss = run.forward_backward(model, x, y, loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return {"run": run, "step": step}


def timed(step: Callable[[], float], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mini", choices=sorted(gpt.SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per side, alternated")
    parser.add_argument("--out", default="benchmarks/results/compile-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = gpt.SIZES[args.size]
    sides = {"eager": build(cfg, False, args.batch)}
    for _ in range(2):  # the same two steps as the compiled side's, so losses compare
        sides["eager"]["step"]()
    start = time.perf_counter()
    sides["compiled"] = build(cfg, True, args.batch)
    first = [sides["compiled"]["step"]() for _ in range(2)]  # the compile happens in the first steps
    compile_s = time.perf_counter() - start
    losses = {name: side["step"]() for name, side in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.blocks):
        for name, side in sides.items():
            times[name].append(timed(side["step"], args.steps))
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/compile_cpu.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1},
        "workload": {"size": args.size, "batch": args.batch, "layers": cfg.layers, "d_model": cfg.d_model,
                     "seq": cfg.seq},
        "compile_s": round(compile_s, 2), "first_losses": first, "losses_after_warmup": losses,
        "step_s": {name: [round(t, 5) for t in ts] for name, ts in times.items()},
        "median_step_s": {name: round(m, 5) for name, m in medians.items()},
        "speedup": round(medians["eager"] / medians["compiled"], 3),
    }
    for side in sides.values():
        side["run"].close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("compile_s", "median_step_s", "speedup")}))


if __name__ == "__main__":
    main()
