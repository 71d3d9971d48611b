"""Peak resident memory of each rank while a model too big for one process is built, prepared, trained, exported.

Sharding (fsdp, pp, fsdp+tp) saves memory only if no rank ever holds the whole model. Built in full on every
rank (`model = Net(...)`), each worker peaks at the whole model, B bytes, before `run.prepare` keeps its share:
N workers need N x B at once, however the model is then split. Built under `with torch.device("meta"):` and
given to `run.prepare` (weights from the modules' own init, or read with `init_from=PATH`), a rank should never
hold more than its share. The goal a meta build is held to, per rank:

    peak RSS <= baseline + 1.25 * B / N + the largest parameter

(baseline: the worker's peak after `import torch, paratrain` and `paratrain.setup`, before the model is built;
the largest parameter: one tensor materialised, read or gathered whole at a time). The goal holds for build,
prepare, export, and `run.save` / `run.load` of a sharded checkpoint; the training steps also hold the gradients
(another B / N per rank), which it does not count, so they are measured and shown but not held to it.

Each case is its own `paratrain run --nproc N` of this file (`--worker`), one at a time, with a timeout; each
rank writes each phase's own peak (VmHWM, reset between phases through /proc/self/clear_refs) and its current RSS
(/proc/self/statm) after every phase into a JSON file of its own, which the driver collects into two markdown
tables and one JSON file (machine, date, commit, torch).

    python benchmarks/big_model_memory.py --small --modes full --out /tmp/small.json      # quick check
    python benchmarks/big_model_memory.py --nproc 2 --out benchmarks/results/big-model-memory.json
    python benchmarks/big_model_memory.py --train-big --gb 7 --out benchmarks/results/big-model-train.json

Default model: 24 x (Linear(2048, 8192) -> GELU -> Linear(8192, 2048)) with a residual, fp32:
24 * (2 * 2048 * 8192 + 8192 + 2048) * 4 = 3,222,208,512 bytes (3.22 GB, 3.00 GiB). GB here is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

LAYOUTS = {"single": "single", "fsdp": "fsdp", "pp": "pp", "fsdp+tp": "fsdp+tp"}
"""Layout name -> paratrain strategy. `single` runs on 1 process, `fsdp+tp` on 4 (tp 2 x fsdp 2), the rest on N."""
MODES = ("full", "meta", "meta-file", "meta-dir")
"""full: built whole on every rank; meta: on the meta device, own init; meta-file / meta-dir: on the meta device,
`init_from` one safetensors file / a directory of per-block safetensors files with an index."""
PHASES = ("baseline", "build", "prepare", "steps", "export", "save", "load")
GOAL_PHASES = ("build", "prepare", "export", "save", "load")
"""The phases held to the goal: the steps also hold gradients (another B/N per rank), which it does not count."""
GB = 1e9
BATCH = 4
"""Global batch: 4 rows of d features."""


class Block(nn.Module):
    """Linear(d, 4d) -> GELU -> Linear(4d, d) with a residual: the shape tensor parallelism splits by structure."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    """`blocks` Blocks in a ModuleList, run in order: what pipelines split and fsdp shards block by block."""

    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def model_bytes(d: int, blocks: int) -> tuple[int, int]:
    """(all parameter bytes B, the largest parameter's bytes), counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        sizes = [p.numel() * p.element_size() for p in Net(d, blocks).parameters()]
    return sum(sizes), max(sizes)


# -- memory probes --------------------------------------------------------------------------------------------

def rss_now() -> int:
    """Resident bytes now (/proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """This process's peak resident bytes since the last `reset_peak` (VmHWM; ru_maxrss, which never resets, where
    /proc/self/status has no VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Start the next phase's peak from the resident set now (writing 5 to clear_refs resets VmHWM)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def mem_info(field: str) -> int:
    """A /proc/meminfo field in bytes (MemTotal: the machine's RAM; MemAvailable: what a case may still use)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


# -- the worker: one rank of one case --------------------------------------------------------------------------

def local_bytes(module: nn.Module) -> int:
    """Parameter bytes this rank holds: a DTensor counts its local shard, a pipeline rank its own stage."""
    from torch.distributed.tensor import DTensor

    held = (p.to_local() if isinstance(p, DTensor) else p for p in module.parameters())
    return sum(t.numel() * t.element_size() for t in held)


def build(mode: str, d: int, blocks: int) -> nn.Module:
    """The whole model on every rank (full), or its shapes only (meta): prepare materialises the meta one."""
    if mode == "full":
        return Net(d, blocks)
    with torch.device("meta"):
        return Net(d, blocks)


def batch(run: Any, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of one fixed global batch (tensor-parallel and pipeline ranks share theirs)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, d, generator=g), torch.randn(BATCH, d, generator=g)
    rows = run.per_worker_batch(BATCH)
    replica, _ = run.strategy.data_shard(run.ctx)
    return x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]


class Record:
    """One rank's measurements, rewritten after every phase so a case that fails later keeps what it measured."""

    def __init__(self, path: Path, **about: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {**about, "phases": {}}
        self.start = time.perf_counter()

    def phase(self, name: str) -> None:
        self.data["phases"][name] = {"peak": rss_peak(), "rss": rss_now(), "at_s": time.perf_counter() - self.start}
        self.save()
        reset_peak()  # each phase's peak is its own

    def fail(self, exc: BaseException) -> None:
        """What stopped this rank, in which phase and when (wall clock: the first rank to fail names the cause, its
        peers' errors are mostly that rank's absence)."""
        cause = f" (cause: {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        phase = next((p for p in PHASES if p not in self.data["phases"]), "close")
        self.data["error"] = {"rank": self.data["rank"], "phase": phase, "time": time.time(),
                              "message": f"{type(exc).__name__}: {exc}{cause}"[:1000]}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def worker(args: argparse.Namespace) -> None:
    """One rank of a case: setup, the measured phases, and what stopped them if something did."""
    import paratrain

    run = paratrain.setup(strategy=LAYOUTS[args.layout], seed=0)
    record = Record(Path(args.rank_dir) / f"rank{run.rank}.json", rank=run.rank, world_size=run.world_size,
                    layout=args.layout, mode=args.mode)
    try:
        phases(run, record, args)
    except BaseException as exc:
        record.fail(exc)
        raise
    run.close()


def phases(run: Any, record: Record, args: argparse.Namespace) -> None:
    """Baseline, build, prepare, `args.steps` SGD steps, export (meta modes with an export dir): RSS after each."""
    record.phase("baseline")
    model = build(args.mode, args.d, args.blocks)
    record.phase("build")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch(run, args.d)
    init = {"init_from": args.init_from} if args.init_from else {}
    model, optimizer = run.prepare(model, optimizer, example=x, **init)
    record.data["holds_bytes"] = local_bytes(run.unwrap(model))
    record.phase("prepare")
    record.data["step_s"], record.data["loss"] = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = run.forward_backward(model, x, y, nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()  # the gradients go before export and save, as in a loop that ends
        record.data["step_s"].append(time.perf_counter() - started)
        record.data["loss"].append(float(loss))
    record.phase("steps")
    if args.export_dir:
        run.export(model, args.export_dir)
        record.phase("export")
    if args.checkpoint_dir:
        state = {"model": model, "optimizer": optimizer, "step": args.steps}
        run.save(state, path=args.checkpoint_dir)
        record.phase("save")
        run.load(state, path=args.checkpoint_dir)
        record.phase("load")
    run.print(f"{args.layout} {args.mode}: rank 0 peak {rss_peak() / GB:.2f} GB, loss {record.data['loss']}")


# -- initial weights on disk, written a block at a time ---------------------------------------------------------

def block_state(d: int, index: int) -> dict[str, torch.Tensor]:
    """Block `index`'s weights under the model's names; seeded per block, so the file and the directory agree."""
    torch.manual_seed(index)
    return {f"blocks.{index}.{k}": v for k, v in Block(d).state_dict().items()}


def write_file(path: Path, d: int, blocks: int) -> None:
    """One safetensors file, streamed: the header comes from the shapes alone, then each block's bytes follow,
    so the writer holds one block, never the model (safetensors' save_file would take the whole dict)."""
    with torch.device("meta"):
        shapes = [(k, v.shape) for i in range(blocks) for k, v in block_state(d, i).items()]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i in range(blocks):
            for tensor in block_state(d, i).values():  # the header's order: same names, same order
                f.write(tensor.contiguous().numpy().tobytes())


def write_dir(path: Path, d: int, blocks: int) -> None:
    """A directory as Hugging Face shards a model: one safetensors file per block and an index naming each one."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i in range(blocks):
        name = f"model-{i + 1:05d}-of-{blocks:05d}.safetensors"
        state = block_state(d, i)
        save_file(state, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, name))
        total += sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_init(scratch: Path, modes: list[str], d: int, blocks: int) -> dict[str, Path]:
    """The init_from path of each meta mode that reads one, written once before the cases run."""
    paths: dict[str, Path] = {}
    if "meta-file" in modes:
        paths["meta-file"] = scratch / "init.safetensors"
        write_file(paths["meta-file"], d, blocks)
    if "meta-dir" in modes:
        paths["meta-dir"] = scratch / "init"
        write_dir(paths["meta-dir"], d, blocks)
    return paths


# -- the driver: one `paratrain run` per case -------------------------------------------------------------------

def need_bytes(mode: str, nproc: int, total: int) -> int:
    """A rough bound on the machine memory a case takes, to refuse one that would push the shared machine into
    swap or the OOM killer: a full build holds B per rank, then params + grads are 2B over all ranks."""
    per_process = int(0.6 * GB)
    return nproc * per_process + 2 * total + (nproc * total if mode == "full" else 0)


def launch(case: dict[str, Any], args: argparse.Namespace, scratch: Path, init: dict[str, Path]) -> dict[str, Any]:
    """Run one case under `paratrain run`, in its own process group (killed whole on timeout); the per-rank
    records it left, its status and the tail of its output."""
    name = f"{case['layout']}-{case['mode']}-{case['nproc']}".replace("+", "_")
    rank_dir, export_dir, checkpoint_dir = scratch / name, scratch / f"{name}-export", scratch / f"{name}-ckpt"
    rank_dir.mkdir(parents=True, exist_ok=True)
    job = {"layout": case["layout"], "mode": case["mode"], "d": case["d"], "blocks": case["blocks"],
           "steps": case["steps"], "rank_dir": str(rank_dir),
           "init_from": str(init[case["mode"]]) if case["mode"] in init else None,
           "export_dir": str(export_dir) if case["mode"] != "full" and case.get("export", True) else None,
           "checkpoint_dir": str(checkpoint_dir) if case.get("export", True) else None}
    # One JSON argument: torchrun's parser would take `--d` for its own `--duplicate-stdout-filters` (a prefix)
    command = [sys.executable, "-m", "paratrain.cli", "run", "--nproc", str(case["nproc"]), __file__, "--worker",
               json.dumps(job)]
    log = rank_dir / "log.txt"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=args.timeout) == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: the session started above
            proc.wait()
            status = f"timeout after {args.timeout} s"
    ranks = [json.loads(p.read_text()) for p in sorted(rank_dir.glob("rank*.json"))]
    result = {**case, "status": status, "wall_s": time.monotonic() - started, "ranks": ranks}
    if export_dir.exists():
        result["export_bytes"] = sum(p.stat().st_size for p in export_dir.rglob("*") if p.is_file())
        shutil.rmtree(export_dir)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    if status != "ok":
        lines = log.read_text(errors="replace").splitlines()
        result["output_tail"] = lines[-60:]
        result["error"] = first_error(ranks, lines)
    return result


def first_error(ranks: list[dict[str, Any]], lines: list[str]) -> str:
    """The error of the rank that failed first; else (killed: timeout, out of memory) the log's last error line."""
    errors = sorted((r["error"] for r in ranks if "error" in r), key=lambda e: e["time"])
    if errors:
        return f"rank {errors[0]['rank']} in {errors[0]['phase']}: {errors[0]['message']}"
    return next((x for x in reversed(lines) if "Error" in x or "Killed" in x), lines[-1] if lines else "")


def summarise(result: dict[str, Any], total: int, largest: int) -> dict[str, Any]:
    """The table's numbers for one case: per-rank peaks against baseline + 1.25 B/N + the largest parameter."""
    ranks, n = result["ranks"], result["nproc"]
    if len(ranks) < n:
        return {"complete": False}
    peaks = [max(p["peak"] for p in r["phases"].values()) for r in ranks]
    held = [max(r["phases"][ph]["peak"] for ph in GOAL_PHASES if ph in r["phases"]) for r in ranks]
    goals = [r["phases"]["baseline"]["peak"] + 1.25 * total / n + largest for r in ranks]
    by_phase = {ph: max(r["phases"][ph]["peak"] for r in ranks) for ph in PHASES if all(ph in r["phases"]
                                                                                          for r in ranks)}
    holds = [r["holds_bytes"] for r in ranks if "holds_bytes" in r]
    steps = [s for r in ranks for s in r.get("step_s", [])]
    return {"complete": True, "holds_max": max(holds) if len(holds) == n else None, "peak_max": max(peaks),
            "peak_sum": sum(peaks), "goal_max": max(goals),
            "goal_phases_max": max(held),
            "within": all(p <= g for p, g in zip(held, goals)) if result["status"] == "ok" else None,
            "peak_by_phase": by_phase, "step_s_max": max(steps) if steps else None}


def gb(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.3f}"


def tables(results: list[dict[str, Any]]) -> str:
    """Markdown: the goal table, then each phase's peak (max over ranks) and the slowest step."""
    head = ("| layout | mode | holds after prepare (GB, max rank) | peak per rank (GB, max) | all ranks together (GB) "
            "| peak outside the steps (GB, max rank) | goal (GB) | within goal? |\n|---|---|---|---|---|---|---|---|")
    rows, phase_rows = [head], ["| layout | mode | " + " | ".join(f"{p} (GB)" for p in PHASES)
                                + " | slowest step (s) |\n|---|---|" + "---|" * (len(PHASES) + 1)]
    for r in results:
        s, label = r["summary"], f"| {r['layout']} x{r['nproc']} | {r['mode']} |"
        failed = "" if r["status"] == "ok" else f"{r['status']}: {(r.get('error') or '?').splitlines()[0][:160]}"
        if not s["complete"]:
            rows.append(f"{label} {failed or 'no rank records'} | | | | | |")
            continue
        within = {True: "yes", False: "no", None: f"n/a ({failed})"}[s["within"]]
        rows.append(f"{label} {gb(s['holds_max'])} | {gb(s['peak_max'])} | {gb(s['peak_sum'])} | "
                    f"{gb(s['goal_phases_max'])} | {gb(s['goal_max'])} | {within} |")
        cells = [gb(s["peak_by_phase"].get(p)) for p in PHASES]
        step = "-" if s["step_s_max"] is None else f"{s['step_s_max']:.2f}"
        phase_rows.append(f"{label} " + " | ".join(cells) + f" | {step} |")
    caption = "Each phase's own peak RSS (VmHWM, reset between phases; max over ranks):"
    return "\n".join(rows) + f"\n\n{caption}\n\n" + "\n".join(phase_rows)


def machine() -> dict[str, Any]:
    """Where and when: cores, RAM, date, commit (with -dirty: src/ may be mid-edit), torch."""
    here = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=here, text=True,
                                capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "ram_bytes": mem_info("MemTotal"), "available_bytes": mem_info("MemAvailable"), "commit": commit,
            "torch": torch.__version__, "python": sys.version.split()[0]}


def cases(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Every layout x mode asked for, at its process count; and the layouts left out, with why."""
    found, skipped = [], []
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            raise SystemExit(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
        nproc = 1 if layout == "single" else args.nproc
        if layout == "fsdp+tp" and nproc != 4:
            skipped.append(f"fsdp+tp runs at --nproc 4 only (tp 2 x fsdp 2), not {nproc}")
            continue
        if layout == "pp" and nproc < 2:
            skipped.append("pp needs --nproc 2 or more")
            continue
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
            found.append({"layout": layout, "mode": mode, "nproc": nproc, "d": args.d, "blocks": args.blocks,
                          "steps": args.steps})
    return found, skipped


def run_case(case: dict[str, Any], args: argparse.Namespace, scratch: Path, init: dict[str, Path],
             total: int, largest: int) -> dict[str, Any]:
    """One case, unless the machine's available memory cannot hold it (then refused, with the arithmetic)."""
    need, available = need_bytes(case["mode"], case["nproc"], total), mem_info("MemAvailable")
    if need > available and not args.force:
        why = f"needs about {need / GB:.1f} GB, {available / GB:.1f} GB available (--force runs it anyway)"
        print(f"skip {case['layout']} x{case['nproc']} {case['mode']}: {why}", flush=True)
        result = {**case, "status": "skipped", "error": why, "ranks": []}
    else:
        print(f"run  {case['layout']} x{case['nproc']} {case['mode']} ...", flush=True)
        result = launch(case, args, scratch, init)
        print(f"     {result['status']} in {result['wall_s']:.0f} s", flush=True)
    result["summary"] = summarise(result, total, largest)
    return result


def write(out: str, payload: dict[str, Any]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")


def table_run(args: argparse.Namespace, scratch: Path) -> None:
    """Every case in turn; the tables on stdout and everything in --out."""
    total, largest = model_bytes(args.d, args.blocks)
    print(f"model: {args.blocks} x (Linear({args.d}, {4 * args.d}) -> GELU -> Linear({4 * args.d}, {args.d})), fp32: "
          f"B = {total:,} bytes ({total / GB:.3f} GB, {total / 2**30:.3f} GiB); largest parameter {largest:,} bytes",
          flush=True)
    todo, skipped = cases(args)
    for why in skipped:
        print(f"skip {why}", flush=True)
    init = write_init(scratch, args.modes.split(","), args.d, args.blocks)
    results = [run_case(c, args, scratch, init, total, largest) for c in todo]
    text = tables(results)
    print("\n" + text)
    write(args.out, {**machine(), "model": {"d": args.d, "blocks": args.blocks, "param_bytes": total,
                                            "largest_param_bytes": largest, "dtype": "float32"},
                     "batch": BATCH, "steps": args.steps, "optimizer": "SGD lr 1e-3, no momentum",
                     "goal": "peak RSS <= baseline peak + 1.25 * B / N + largest parameter", "skipped": skipped,
                     "cases": results, "table": text})


def train_big(args: argparse.Namespace, scratch: Path) -> None:
    """The model that only fits sharded: ~args.gb GB of weights built on meta, 3 SGD steps under fsdp 4."""
    per_block, _ = model_bytes(args.d, 1)
    blocks = max(1, round(args.gb * GB / per_block))
    total, largest = model_bytes(args.d, blocks)
    ram, nproc = mem_info("MemTotal"), 4
    print(f"model: {blocks} blocks of d={args.d}: B = {total:,} bytes ({total / GB:.2f} GB)")
    print(f"built in full on every rank: {nproc} x {total / GB:.2f} GB = {nproc * total / GB:.2f} GB "
          f"{'>' if nproc * total > ram else '<='} RAM {ram / GB:.2f} GB (MemTotal); "
          f"sharded: {total / nproc / GB:.2f} GB of weights per rank (+ as much in gradients)", flush=True)
    case = {"layout": "fsdp", "mode": "meta", "nproc": nproc, "d": args.d, "blocks": blocks, "steps": 3,
            "export": False}
    result = run_case(case, args, scratch, {}, total, largest)
    for r in result["ranks"]:
        peak = max(p["peak"] for p in r["phases"].values())
        steps = ", ".join(f"{s:.2f}" for s in r.get("step_s", []))
        print(f"rank {r['rank']}: peak {peak / GB:.2f} GB (baseline {r['phases']['baseline']['peak'] / GB:.2f}), "
              f"holds {gb(r.get('holds_bytes'))} GB, steps {steps} s")
    s = result["summary"]
    if s["complete"]:
        print(f"all ranks together {s['peak_sum'] / GB:.2f} GB peak vs {nproc * total / GB:.2f} GB for the weights "
              f"alone built on every rank; RAM {ram / GB:.2f} GB; every rank within baseline + 1.25 B/{nproc} + "
              f"largest parameter: {s['within']}")
    else:
        print(f"failed: {result['status']}: {result.get('error', '')}")
    write(args.out, {**machine(), "model": {"d": args.d, "blocks": blocks, "param_bytes": total,
                                            "largest_param_bytes": largest, "dtype": "float32"},
                     "full_build_bytes": nproc * total, "ram_bytes": ram, "case": result})


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--nproc", type=int, default=2, help="processes for fsdp and pp (fsdp+tp runs at 4 only)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/big-model-memory.json, "
                   "-small.json with --small, big-model-train.json with --train-big)")
    p.add_argument("--small", action="store_true", help="d=256, blocks=4: a quick check of the script")
    p.add_argument("--train-big", action="store_true", help="~--gb GB of weights on meta, trained under fsdp 4")
    p.add_argument("--gb", type=float, default=7.0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds one case may run")
    p.add_argument("--force", action="store_true", help="run cases the available memory cannot hold")
    p.add_argument("--scratch", default=None, help="where init files, records, exports go (default: a temp dir)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.d, args.blocks = 256, 4
    if args.out is None:
        name = "big-model-train" if args.train_big else "big-model-memory" + ("-small" if args.small else "")
        args.out = f"benchmarks/results/{name}.json"
    return args


def main() -> None:
    args = parse()
    if args.worker:
        worker(argparse.Namespace(**json.loads(args.worker)))
        return
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="big-model-memory-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        (train_big if args.train_big else table_run)(args, scratch)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
