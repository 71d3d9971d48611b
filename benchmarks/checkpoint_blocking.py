"""How long `run.save` stops the training loop: blocking saves against saves written in the background.

2 CPU workers (one thread each, gloo) train a small GPT (paratrain.measure.gpt: nanoGPT's layout) with AdamW under
ddp and under fsdp. Rounds alternate the two modes A B A B (`async_save` is read at each save, so one run holds
both); in each, `steps` timed steps, a barrier, the timed `run.save(state)`, `steps` more timed steps (a background
write runs beside them) and the timed `run.wait_for_save()` (what the write had left after them). Medians over
the rounds after a warm-up round (the first async save makes its process group and its staging buffers: recorded
apart), the slower rank's, are quoted as a fraction of the median training step.

    python benchmarks/checkpoint_blocking.py                       # about 4 minutes on a quiet 2-core machine
    python benchmarks/checkpoint_blocking.py --rounds 2 --steps 2  # a quick look

Results: benchmarks/results/checkpoint_blocking.json (docs/benchmarks.md quotes them). On a shared machine the
numbers are noisy; compare the modes within one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import paratrain

sys.path.insert(0, str(Path(__file__).parent))
from _emit import commit, emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "async")
MODEL = {"vocab": 8192, "seq": 128, "d_model": 256, "layers": 4, "heads": 4}
"""5.3 M parameters: 21 MB of float32 weights, 63 MB with AdamW's two moments (the replicated checkpoint)."""
ROWS = 8
"""Sequences per worker per step: 1024 tokens, about 35 GFLOP of forward and backward per worker per step."""


def _state_bytes(model: Any, optimizer: Any) -> int:
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    local = [getattr(t, "to_local", lambda t=t: t)() for t in tensors]  # FSDP: this rank's shard
    return sum(t.numel() * t.element_size() for t in local)


def measure(strategy: str, rounds: int, steps: int, folder: str) -> dict[str, Any]:
    from paratrain.measure.gpt import GPT, GPTConfig, NextTokenLoss, tokens

    run = paratrain.setup(strategy=strategy, seed=0, checkpoint_dir=folder, keep_last=2, progress=False,
                          straggler_threshold=None)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg)
    model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x, y = tokens(ROWS, cfg, seed=1 + run.rank)
    loss_fn = NextTokenLoss()
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}

    def step() -> float:
        start = time.perf_counter()
        run.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        return time.perf_counter() - start

    rows: list[dict[str, Any]] = []
    for r in range(rounds + 1):  # round 0 warms up both modes
        for mode in MODES:
            run.config.async_save = mode == "async"
            before = [step() for _ in range(steps)]
            run.barrier()
            start = time.perf_counter()
            run.save(state)
            blocked = time.perf_counter() - start
            beside = [step() for _ in range(steps)]
            start = time.perf_counter()
            run.wait_for_save()
            rows.append({"round": r, "mode": mode, "blocked_s": blocked, "steps_before_s": before,
                         "steps_beside_s": beside, "wait_after_s": time.perf_counter() - start})
    out = {"rank": run.rank, "state_bytes": _state_bytes(run.unwrap(model), optimizer), "rows": rows}
    run.close()
    return out


def summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the measured rounds, the slower rank's."""
    def med(rank: dict[str, Any], mode: str, key: str) -> float:
        values = [r[key] for r in rank["rows"] if r["mode"] == mode and r["round"] > 0]
        return statistics.median(sum(values, []) if isinstance(values[0], list) else values)

    step = max(statistics.median([t for r in rank["rows"] if r["round"] > 0 for t in r["steps_before_s"]])
               for rank in per_rank)
    out: dict[str, Any] = {"step_s": step, "state_bytes_per_rank": [rank["state_bytes"] for rank in per_rank]}
    for mode in MODES:
        blocked = max(med(rank, mode, "blocked_s") for rank in per_rank)
        beside = max(med(rank, mode, "steps_beside_s") for rank in per_rank)
        first = max(next(r["blocked_s"] for r in rank["rows"] if r["mode"] == mode) for rank in per_rank)
        out[mode] = {"blocked_s": blocked, "blocked_fraction_of_step": blocked / step,
                     "first_save_blocked_s": first, "step_beside_write_s": beside,
                     "step_slowdown_beside_write": beside / step - 1,
                     "wait_after_s": max(med(rank, mode, "wait_after_s") for rank in per_rank)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="timed steps before and after each save")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_blocking.json"))
    args = p.parse_args()
    launch = dict(nproc=2, timeout=1800, accelerator="cpu", threads_per_worker=1, prefix_output=False)
    result: dict[str, Any] = {
        "benchmark": "checkpoint_blocking", "commit": commit(), "torch": torch.__version__,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_average": os.getloadavg()},
        "model": {**MODEL, "rows_per_worker": ROWS, "optimizer": "AdamW"},
        "rounds": args.rounds, "steps": args.steps, "strategies": {},
    }
    for strategy in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory(prefix="paratrain-ckpt-bench-") as folder:
            per_rank = paratrain.launch(measure, strategy, args.rounds, args.steps, folder, all_ranks=True, **launch)
        result["strategies"][strategy] = {"summary": summary(per_rank), "per_rank": per_rank}
        s = result["strategies"][strategy]["summary"]
        print(f"{strategy}: step {s['step_s'] * 1e3:.0f} ms; " + "; ".join(
            f"{m} save blocks {s[m]['blocked_s'] * 1e3:.1f} ms ({s[m]['blocked_fraction_of_step'] * 100:.1f}% of a "
            f"step), steps beside it {s[m]['step_slowdown_beside_write'] * 100:+.0f}%" for m in MODES),
            file=sys.stderr)
    sys.argv[1:] = [args.out]  # emit writes the file named here
    emit(result)


if __name__ == "__main__":
    main()
