"""What expert and context parallelism cost on this machine, against the same model under plain `ddp`.

Expert parallelism sends every token to the rank that holds its expert and back (two all-to-alls per MoE layer,
counts first); context parallelism gathers every attention layer's keys and values and the outputs. Both buy
memory (each rank holds 1/ep of the experts, or 1/cp of every sequence's activations), not speed, on two CPU
workers; this measures the price: the step time of `ep 2` over `ddp 2` on the user MoE decoder of the tests
(router `Linear`, top-2 of 8 experts as a `ModuleList`), and of `cp 2` over `ddp 2` on the RoPE decoder with SDPA
at sequence 256, the same global batch.

Each side is its own `paratrain run --nproc 2` of this file (`--worker`), in rounds A B B A; each run times its
steps after a warm-up and writes them. The ratio is the median of the rounds' paired median ratios, with its 95%
bootstrap interval (`paratrain.measure.stats`), so the machine's drift between rounds divides out.

    python benchmarks/ep_cp_overhead.py --out benchmarks/results/ep-cp-overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PAIRS = (("moe", "ddp", "ep"), ("mixtral", "ddp", "ep"), ("long", "ddp", "cp"))
"""(model, baseline layout, measured layout): the user's listed experts (one exchange per expert call), Hugging
Face Mixtral's stacked experts (two all-to-alls per layer), the RoPE decoder at sequence 256."""


def _model(name: str):  # type: ignore[no-untyped-def]
    import moe_cases as cases
    import torch

    torch.manual_seed(0)
    if name == "moe":
        cases.EXPERTS, cases.WIDTH, cases.SEQ = 8, 128, 64  # the decoder reads them when built
        return cases.Decoder(), 64, cases.SEQ
    if name == "mixtral":
        import transformers as tf

        tf.logging.set_verbosity_error()
        config = tf.MixtralConfig(vocab_size=cases.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  num_local_experts=8, num_experts_per_tok=2)
        return tf.MixtralForCausalLM(config), 64, 64
    cases.WIDTH, cases.LONG_SEQ = 128, 256
    return cases.RopeDecoder(), 8, cases.LONG_SEQ


def worker(layout: str, name: str, steps: int, warmup: int, out: str) -> None:
    import moe_cases as cases
    import torch

    import paratrain

    run = paratrain.setup(strategy=layout, seed=0, timeout_s=300)
    model, batch, seq = _model(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cases.VOCAB, (batch, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    per = run.per_worker_batch(batch)
    replica = run.strategy.data_shard(run.ctx)[0]
    rows = slice(replica * per, (replica + 1) * per)
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    times = []
    for step in range(warmup + steps):
        float(run.all_reduce(torch.tensor(0.0)))  # start together
        start = time.perf_counter()
        run.forward_backward(model, x[rows], y[rows], cases.loss_fn)
        opt.step()
        opt.zero_grad()
        float(run.all_reduce(torch.tensor(0.0)))  # every rank done: the slowest rank's step
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if run.is_main:
        Path(out).write_text(json.dumps(times))
    run.close()


def _one(layout: str, name: str, steps: int, warmup: int, scratch: Path, timeout: float) -> list[float]:
    out = scratch / f"{name}-{layout}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "paratrain.cli", "run", "--nproc", "2", __file__, "--worker", layout, name,
           str(steps), str(warmup), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                          env=env, cwd=ROOT)
    if done.returncode or not out.exists():
        raise SystemExit(f"{layout} {name} failed:\n{done.stdout[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--models", default=",".join(name for name, _, _ in PAIRS))
    p.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        layout, name, steps, warmup, out = args.worker
        worker(layout, name, int(steps), int(warmup), out)
        return
    from paratrain.measure import stats

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, base, measured in (pair for pair in PAIRS if pair[0] in args.models.split(",")):
            medians: dict[str, list[float]] = {base: [], measured: []}
            steps: dict[str, list[float]] = {base: [], measured: []}
            for r in range(args.rounds):
                order = (base, measured) if r % 4 in (0, 3) else (measured, base)  # A B, B A, B A, A B
                for layout in order:
                    times = _one(layout, name, args.steps, args.warmup, Path(tmp), args.timeout)
                    medians[layout].append(statistics.median(times))
                    steps[layout] += times
                print(f"  {name} round {r + 1}: {base} {medians[base][-1] * 1e3:.1f} ms, "
                      f"{measured} {medians[measured][-1] * 1e3:.1f} ms", flush=True)
            ratio = stats.paired_ratio(medians[measured], medians[base])
            results.append({"model": name, "baseline": base, "layout": measured, "rounds": args.rounds,
                            "steps_per_round": args.steps, "median_step_s": {k: statistics.median(v)
                                                                           for k, v in medians.items()},
                            "round_medians_s": medians, "ratio": ratio.value, "ratio_ci": ratio.interval,
                            "verdict": stats.verdict(ratio)})
            print(f"{measured} 2 / {base} 2 on {name}: {stats.verdict(ratio)}", flush=True)
    record = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "results": results}
    out = Path(args.out or ROOT / "benchmarks" / "results" / "ep-cp-overhead.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
