"""The current tables of docs/benchmarks.md, made from the results JSON in benchmarks/results/.

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->` in the doc; `TABLES[NAME]` is
the one function that makes it, from the file(s) it names, so every number there comes from a recorded run.

    python benchmarks/docs_tables.py                        # rewrite every generated block
    python benchmarks/docs_tables.py --check                # exit 1 if a block differs from what its JSON gives
    python benchmarks/docs_tables.py --record results/bench # keep a `make bench` run in benchmarks/results/, then
                                                            # rewrite (table A shows the newest one kept)

tests/test_docs_tables.py runs the check in process, so the doc cannot drift from its JSON.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.measure import stats

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"<!-- generated: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- end generated: (?P=name) -->", re.S)


def _load(relative: str) -> dict[str, Any]:
    return json.loads((RESULTS / relative).read_text())


def _source(*relative: str) -> str:
    """Links to the files a table comes from, relative to docs/."""
    return ", ".join(f"[benchmarks/results/{r}](../benchmarks/results/{r})" for r in relative)


def _newest(pattern: str) -> str:
    """The recorded run matching `pattern` (under benchmarks/results/) with the latest `created`."""
    paths = sorted(RESULTS.glob(pattern), key=lambda p: json.loads(p.read_text())["created"])
    if not paths:
        raise FileNotFoundError(f"no benchmarks/results/{pattern}")
    return str(paths[-1].relative_to(RESULTS))


def _latest(pattern: str) -> str:
    """The file matching `pattern` whose name (it ends in its date) sorts last."""
    paths = sorted(RESULTS.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no benchmarks/results/{pattern}")
    return str(paths[-1].relative_to(RESULTS))


def _ratio(value: float, ci: list[float] | None, samples: int) -> stats.Ratio:
    low, high = ci if ci else (None, None)
    return stats.Ratio(value, low, high, paired=True, samples=samples)


def _table(header: list[str], rows: list[list[str]], right: int = 0) -> list[str]:
    """A Markdown table; the last `right` columns right-aligned."""
    align = ["---"] * (len(header) - right) + ["---:"] * right
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _run_name(r: dict[str, Any]) -> str:
    options = "".join(f" {'V=' if k == 'stages_per_worker' else ''}{v}" for k, v in (r.get("options") or {}).items())
    return f"`{r['strategy']}{options}`"


def _cmd(command: str) -> str:
    """A recorded command without its `--out DIR` (often a temporary folder of the machine it ran on)."""
    return re.sub(r" --out \S+", "", command)


def _commit(value: str | None) -> str:
    return f"commit `{value}`" if value else "commit not recorded"


def _x(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else f"{value:{fmt}}x"


def _peak(peak: dict[str, Any]) -> str:
    return f"{peak['flops_per_s'] / 1e12:.1f} TFLOP/s {peak['dtype']} ({peak['source'].split(':')[0]})"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


# ---- A: `make bench` ------------------------------------------------------------------------------------------


def make_bench() -> str:
    """The newest `make bench` run kept with --record: every configuration, its speedup over one worker timed in the
    same rounds and its ratio to the hand-written twin, each with its 95% interval, in the bench's own words."""
    rel = _newest("make-bench-*/results.json")
    d = _load(rel)
    m, load = d["machine"], d["machine"].get("load_average") or {}
    shared = load.get("start") is not None and load["start"] > m["cores"] / 2
    lines = [f"`{_cmd(d['command'])}` at {d['created']}, {_commit(d['paratrain'].get('commit'))}: {m['cpu']}, "
             f"{m['cores']} of {m.get('cores_total', m['cores'])} cores, GPUs: {', '.join(m['gpus']) or 'none'}, "
             f"torch {m['torch']}; workload {d['workload']['description']}, global batch {d['global_batch']}; "
             f"{d['settings']['repeat']} x {d['settings']['steps']} steps per side."
             + (f" Load average {load['start']} at the start and {load['end']} at the end" if load else "")
             + (" (above half the cores: other work shared the machine, which lowers speedups by more than their "
                "intervals)." if shared else "." if load else ""),
             f"Source: {_source(rel)}.", ""]
    rows = []
    for r in d["runs"]:
        if r["status"] != "ok":
            continue
        n = len(r["step_times_s"])
        speedup = None if r["speedup_vs_single"] is None else _ratio(r["speedup_vs_single"], r.get("speedup_ci"), n)
        baseline = r["strategy"] == "single"
        speed = "-" if speedup is None else f"{speedup.value:.2f}x (the baseline)" if baseline else (
            f"{speedup.value:.2f}x" + (f" ({speedup.low:.2f}-{speedup.high:.2f})" if speedup.low is not None else ""))
        bound = "-" if baseline or speedup is None else stats.against_bound(speedup, r["bound"])
        twin = "-" if r["vs_reference"] is None else \
            f"{r['reference']}: {stats.verdict(_ratio(r['vs_reference'], r.get('ratio_ci'), n))}"
        rows.append([_run_name(r), str(r["workers"]), "-" if r["microbatches"] is None else str(r["microbatches"]),
                     r["schedule"] or "-", f"{r['median_step_s']:.4f}", speed, bound, twin])
    lines += _table(["run", "workers", "M", "schedule", "median step (s)", "speedup over one worker (95% CI)",
                     "against its bound", "paratrain / hand-written"], rows)
    skipped = [f"`{r['strategy']}` ({r['status']}: {r['reason']})" for r in d["runs"] if r["status"] != "ok"]
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines)


# ---- E: fault tolerance ---------------------------------------------------------------------------------------


def fault_recovery() -> str:
    rel = "fault_recovery.json"
    d = _load(rel)
    s, rows = d["setup"], []
    for row in d["summary"]:
        rows.append([str(row["interval"]), f"{row['death_to_resumed_s']:.2f}", f"{row['restart_s']:.2f}",
                     f"{row['resume_s']:.2f}", f"{row['steps_lost']:g}", f"{1000 * row['save_s']:.0f}"])
    step_ms = 1000 * d["summary"][0]["step_s"]
    return "\n".join([
        f"`{d['command']}` at {d['date']}, commit `{d['commit'][:8]}`, torch {d['torch']}, {d['machine']['cpus']} "
        f"CPU cores: {s['workers']} workers ({s['backend']}), a worker killed after step "
        f"{', '.join(map(str, s['kills']))}, medians of {s['repeats']} runs per interval; a step takes "
        f"{step_ms:.1f} ms.",
        f"Source: {_source(rel)}.", "",
        *_table(["checkpoint every N steps", "death → resumed (s)", "of which detect + restart", "build + load",
                 "steps lost", "save (ms)"], rows, right=5)])


# ---- F: the gpt workload on CPU workers -----------------------------------------------------------------------


def gpt_cpu() -> str:
    rel = _newest("gpt-cpu-*/results.json")
    d = _load(rel)
    m, w = d["machine"], d["workload"]
    rows = [[_run_name(r), str(r["workers"]), "-" if r["microbatches"] is None else str(r["microbatches"]),
             r["schedule"] or "-", f"{r['median_step_s']:.4f}", f"{r['tokens_per_s']:.0f}", _pct(r["mfu"]),
             _x(r["speedup_vs_single"]), "-" if r["vs_reference"] is None else f"{r['vs_reference']:.3f}"]
            for r in d["runs"] if r["status"] == "ok"]
    peak = m.get("peak") or {}
    return "\n".join([
        f"`{_cmd(d['command'])}` at {d['created']}, {_commit(d['paratrain'].get('commit'))}: {m['cpu']}, {m['cores']} "
        f"cores, torch {m['torch']}; {w['description']}, {w['parameters'] / 1e6:.1f} M parameters, global batch "
        f"{d['global_batch']} ({d['global_batch'] * w['tokens_per_sample']} tokens), "
        f"{w['flops_per_step'] / 1e9:.1f} GFLOP a step; MFU against {peak.get('flops_per_s', 0) / 1e9:.1f} GFLOP/s "
        f"per one-thread worker, measured. Schema `{d['schema']}`: ratios of medians of "
        f"{d['settings']['repeat']} blocks of {d['settings']['steps']} steps, no intervals.",
        f"Source: {_source(rel)}.", "",
        *_table(["run", "workers", "M", "schedule", "median step (s)", "tokens/s", "MFU", "speedup",
                 "paratrain / hand-written"], rows)])


# ---- G: the gpt workload on a GPU -----------------------------------------------------------------------------

_GPU_RUNS = {"single": "paratrain `single`", "no-comm": "hand-written loop (`no-comm`)",
             "ddp": "paratrain `ddp` (nccl, 1 worker)", "torch-ddp": "hand-written DDP"}


def gpu_gpt() -> str:
    rel = "gpu-tier-2026-11-27-h200/gpu.json"
    d = _load(rel)["gpt_bench"]
    rows, ratios = [], []
    for precision, b in d.items():
        for run, label in _GPU_RUNS.items():
            r = b["runs"][run]
            rows.append([precision, label, f"{r['median_step_s']:.4f}", f"{r['tokens_per_s']:,.0f}", _pct(r["mfu"]),
                         f"{r['peak_memory_mb']:,.0f}"])
        ratios.append(f"{precision}: `single` {b['single_vs_handwritten']:.4f}x the hand-written loop's step time, "
                      f"`ddp` {b['runs']['ddp']['vs_reference']:.4f}x hand-written DDP's")
    first = next(iter(d.values()))
    settings = first["results_json"]["settings"]
    return "\n".join([
        f"`{_cmd(first['command'])}` (and `--precision bf16`) at {', '.join(b['created'] for b in d.values())}: "
        f"{', '.join(first['gpus'])}, torch {first['torch']}; GPT-2 small, {settings['repeat']} x "
        f"{settings['steps']} steps after {settings['warmup']} warm-up; MFU against "
        + ", ".join(_peak(b["peak"]) for b in d.values()) + ".",
        f"Source: {_source(rel)}.", "",
        *_table(["precision", "run", "median step (s)", "tokens/s", "MFU", "peak memory (MB)"], rows, right=4), "",
        "paratrain / hand-written: " + "; ".join(ratios) + "."])


# ---- H: how close to the machine (`make limits`) --------------------------------------------------------------


def _limits_report() -> Any:
    spec = importlib.util.spec_from_file_location("limits_report", ROOT / "benchmarks" / "limits_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def limits() -> str:
    """The newest `make limits` run's verdicts, in limits_report.py's own words, from its summary.json."""
    runs = sorted(RESULTS.glob("limits-quick-*/summary.json"), key=lambda p: _load(f"{p.parent.name}/sched.json")
                  ["created"])
    folder = runs[-1].parent.name
    sched = _load(f"{folder}/sched.json")
    m = sched["machine"]
    return "\n".join([
        f"`make limits` (`bash benchmarks/bench_limits.sh --quick`), its first job at {sched['created']}, "
        f"{_commit(sched['paratrain'].get('commit'))}: {m['cpu']}, {m['cores']} cores, torch {m['torch']}.",
        f"Source: {_source(folder + '/summary.json')} (and the runs beside it).", "",
        _limits_report().markdown(_load(f"{folder}/summary.json")).rstrip()])


# ---- I2: the N-D layouts beside their hand-written twins ------------------------------------------------------


def nd_overhead() -> str:
    rel = "nd-overhead.json"
    d = _load(rel)
    rows = [[f"`{x['strategy']}`", str(x["workers"]), f"{x['paratrain_median_s']:.4f}",
             f"{x['reference_median_s']:.4f}", f"{x['ratio_of_medians']:.3f}", f"{x['median_paired_ratio']:.3f}",
             f"{x['ratio_ci95'][0]:.3f}-{x['ratio_ci95'][1]:.3f}"] for x in d["layouts"]]
    more = []
    for extra in sorted(RESULTS.glob("nd-overhead-*.json"), key=lambda p: json.loads(p.read_text())["created"]):
        if extra.name.startswith((EP_CP_TWINS, LISTED_EXPERTS)):
            continue  # layouts of their own tables (nd_overhead_ep_cp, nd_overhead_listed)
        e = json.loads(extra.read_text())
        for x in e["layouts"]:
            more.append(f"`{x['strategy']}` {x['ratio_of_medians']:.3f} (paired {x['median_paired_ratio']:.3f}, "
                        f"{x['ratio_ci95'][0]:.3f}-{x['ratio_ci95'][1]:.3f}) in {x['steps']} pairs at {e['created']} "
                        f"({_source(extra.name)})")
    return "\n".join([
        f"`python benchmarks/nd_overhead.py` at {d['created']}: {d['workload']}, {d['microbatches']} micro-batches "
        f"({d['schedule']}) where pipelined, {d['cores']} cores, torch {d['torch']}; "
        f"{d['layouts'][0]['steps']} steps a side, alternated A B B A, each timed alone.",
        f"Source: {_source(rel)}.", "",
        *_table(["layout", "workers", "paratrain s", "hand-written s", "ratio of medians", "median paired ratio",
                 "95% interval"], rows, right=6),
        *(["", "Runs of one layout beside it: " + "; ".join(more) + "."] if more else [])])


EP_CP_TWINS = "nd-overhead-ep-cp-"
"""Runs of `nd_overhead.py --layouts ep:2,cp:2,ep:2:mixtral`: expert and context parallelism beside their
hand-written twins."""
_TWIN_WORKLOADS = {"gpt-moe": "GPT, 8 listed experts top-2 per block", "gpt-long": "GPT, 1,024 tokens a sequence",
                   "mixtral": "Hugging Face Mixtral, 8 grouped experts top-2, width 128, on gpt-moe's batches"}


def nd_overhead_ep_cp() -> str:
    rel = _latest(f"{EP_CP_TWINS}*.json")
    d = _load(rel)
    rows = []
    for x in d["layouts"]:
        paired = _ratio(x["median_paired_ratio"], x["paired_ci95"], x["steps"])
        name = x["workload"].split()[0]
        rows.append([f"`{x['strategy']}`", str(x["workers"]), f"`{x['workload']}`: {_TWIN_WORKLOADS.get(name, name)}",
                     f"`{x['reference']}`",
                     f"{x['paratrain_median_s']:.4f}", f"{x['reference_median_s']:.4f}",
                     f"{x['ratio_of_medians']:.3f} ({x['ratio_ci95'][0]:.3f}-{x['ratio_ci95'][1]:.3f})",
                     stats.verdict(paired)])
    load = ", ".join(f"{v:.1f}" for v in d["load_average"])
    return "\n".join([
        f"`python benchmarks/nd_overhead.py --layouts ep:2,cp:2,ep:2:mixtral` at {d['created']}: global batch 8, SGD, "
        f"{d['cores']} "
        f"cores (load average {load} at the end), torch {d['torch']}; {d['layouts'][0]['steps']} steps a side, "
        "alternated A B B A in the same workers, each timed alone.",
        f"Source: {_source(rel)}.", "",
        *_table(["layout", "workers", "workload", "hand-written twin", "paratrain s", "hand-written s",
                 "ratio of medians (95% interval)", "median paired ratio"], rows, right=4)])


LISTED_EXPERTS = "nd-overhead-ep-listed-"
"""Runs of `nd_overhead.py --layouts ep:2` after listed experts exchange a block's rows once per forward."""


def nd_overhead_listed() -> str:
    rows = []
    for path in sorted(RESULTS.glob(f"{LISTED_EXPERTS}*.json"), key=lambda p: json.loads(p.read_text())["created"]):
        d = json.loads(path.read_text())
        x = d["layouts"][0]
        paired = _ratio(x["median_paired_ratio"], x["paired_ci95"], x["steps"])
        rows.append([d["created"], f"{d['load_average'][0]:.1f}", str(x["steps"]), f"{x['paratrain_median_s']:.4f}",
                     f"{x['reference_median_s']:.4f}", stats.verdict(paired), _source(path.name)])
    return "\n".join([
        "`python benchmarks/nd_overhead.py --layouts ep:2` (gpt-moe, 8 listed experts top-2 per block, beside "
        "`torch-ep`), each run alternated A B B A in the same workers; the load average is the machine's at the end "
        "of the run (2 cores: above 2, other jobs shared them).",
        "Source: " + ", ".join(row[-1] for row in rows) + ".", "",
        *_table(["created", "load average", "pairs", "paratrain s", "hand-written s", "median paired ratio"],
                [row[:-1] for row in rows], right=5)])


# ---- J: compile on CPU ----------------------------------------------------------------------------------------


def compile_cpu() -> str:
    rel = "compile-cpu.json"
    d = _load(rel)
    w, losses = d["workload"], d["losses_after_warmup"]
    rows = [[f"`gpt` {w['size']} ({w['layers']} blocks of {w['d_model']}, {w['seq']} tokens, batch {w['batch']})",
             str(len(d["step_s"]["eager"])), f"{d['median_step_s']['eager']:.4f}",
             f"{d['median_step_s']['compiled']:.4f}", f"{d['speedup']:.3f}x", f"{d['compile_s']:.1f}",
             f"{abs(losses['eager'] - losses['compiled']):.0e}"]]
    return "\n".join([
        f"`{d['command']}` at {d['created']}: {d['machine']['threads']} CPU thread, torch {d['machine']['torch']}; "
        "eager and compiled (inductor, per block) timed in alternating blocks of steps.",
        f"Source: {_source(rel)}.", "",
        *_table(["model", "blocks a side", "eager median step (s)", "compiled median step (s)",
                 "compiled / eager speed", "inductor compile (s)", "loss difference after warm-up"], rows, right=6)])


# ---- K: bench --plan ------------------------------------------------------------------------------------------


def _winner(w: dict[str, Any]) -> str:
    return f"`{w['strategy']} {w['workers']}`"


def bench_plan() -> str:
    files = ["bench-plan.json", "bench-plan-reversed.json"]
    rows = []
    for rel in files:
        d = _load(rel)
        order = "plan, then sweep" if d["order"] == "plan,sweep" else "sweep, then plan"
        rows.append([order, d["created"], f"{d['plan_wall_s']:.0f} s", f"{d['sweep_wall_s']:.0f} s",
                     f"{d['time_ratio']:.3f}", f"{d['plan_configurations']} / {d['sweep_configurations']}",
                     f"{_winner(d['plan_winner'])} / {_winner(d['sweep_winner'])}"])
    first = _load(files[0])
    return "\n".join([
        f"`{_cmd(first['commands']['plan'])}` beside `{_cmd(first['commands']['sweep'])}`, one after the other, "
        f"then in the other order; {first['cores']} cores.",
        f"Source: {_source(*files)}.", "",
        *_table(["order", "at", "`--plan` wall", "sweep wall", "ratio", "configurations timed (plan / sweep)",
                 "winner (plan / sweep)"], rows)])


# ---- L: gpt, bf16 and torch.compile on a GPU ------------------------------------------------------------------

_COMPILED = {"single": "paratrain `single`, compile=True",
             "no-comm": "hand-written loop, `torch.compile(model)` (`no-comm`)",
             "ddp": "paratrain `ddp` (nccl, 1 worker), compile=True",
             "torch-ddp": "hand-written DDP over `torch.compile(model)`"}


def gpu_compile() -> str:
    rel = "gpu-checks-2026-11-27-h200/bench-gpt-bf16-compile.json"
    d = _load(rel)
    runs = {r["strategy"]: r for r in d["runs"] if r["status"] == "ok"}
    rows = [[label, f"{runs[k]['median_step_s']:.4f}", f"{runs[k]['spread_s']:.4f}", f"{runs[k]['tokens_per_s']:,.0f}",
             _pct(runs[k]["mfu"]), f"{runs[k]['peak_memory_mb']:,.0f}"] for k, label in _COMPILED.items()]
    m = d["machine"]
    ratio = runs["single"]["median_step_s"] / runs["no-comm"]["median_step_s"]
    return "\n".join([
        f"`{_cmd(d['command'])}` at {d['created']}: {', '.join(m['gpus'])}, torch {m['torch']}; MFU against "
        f"{_peak(m['peak'])}.",
        f"Source: {_source(rel)}.", "",
        *_table(["run", "median step (s)", "IQR (s)", "tokens/s", "MFU", "peak MB"], rows, right=5), "",
        f"paratrain's compiled `single` takes {ratio:.3f}x the compiled hand loop's step time."])


# ---- M: strategy="auto" ---------------------------------------------------------------------------------------


def _layout(key: list[Any], workers: int) -> str:
    strategy, microbatches, schedule, stages = key
    if microbatches is None:
        return f"{strategy} {workers}"
    v = f"V={stages}, " if stages and stages > 1 else ""
    return f"{strategy} {workers} ({schedule}, {v}M={microbatches})"


def auto_choice() -> str:
    rel = "auto-choice.json"
    d = _load(rel)
    rows = []
    for w in d["workloads"]:
        starts, workers = w["starts"], d["workers"]
        chosen = sorted({_layout(s["key"], workers) for s in starts})
        chose = f"`{chosen[0]}` each time" if len(chosen) == 1 else ", ".join(f"`{c}`" for c in chosen)
        steps = sorted(s["step_s"] for s in starts)
        step = f"{steps[0]:.4f} s" if steps[0] == steps[-1] else f"{steps[0]:.4f}-{steps[-1]:.4f} s"
        ranked = sorted((x for x in w["measured"] if x["median_step_s"] is not None), key=lambda x: x["median_step_s"])
        runner = next(x for x in ranked if x["key"] != w["fastest_key"])
        planned = sorted(float(p) for s in starts for p in re.findall(r"planned in ([\d.]+) s", s["line"]))
        rows.append([f"`{w['workload']}`", str(len(starts)), chose, step, f"`{_layout(w['fastest_key'], workers)}`",
                     f"{w['worst_vs_fastest']:.3f}",
                     f"`{_layout(runner['key'], workers)}` {runner['median_step_s']:.4f} s",
                     f"{planned[0]:.1f}-{planned[-1]:.1f} s" if planned else "-", str(w["layouts_measured"])])
    return "\n".join([
        f"`python benchmarks/auto_choice.py` at {d['created']}: {d['workers']} workers on {d['cores']} cores; "
        "each start prepares the workload's model with an example batch under "
        "`strategy=\"auto\"`, then every two-worker layout is timed.",
        f"Source: {_source(rel)}.", "",
        *_table(["workload", "starts", "chose", "its measured step", "fastest measured", "worst choice / fastest",
                 "next fastest", "planning", "layouts timed"], rows)])


# ---- O: streamed data -----------------------------------------------------------------------------------------


def stream_throughput() -> str:
    rel = _latest("stream-throughput-*.json")
    d = _load(rel)
    m, s = d["machine"], d["settings"]
    rows = [[r["format"], str(r["workers"]), f"{r['plain_samples_s']}",
             f"{r['prepared_samples_s']} ({r['prepared_ratio']:.2f})",
             f"{r['shuffled_samples_s']} ({r['shuffled_ratio']:.2f})",
             f"{r['plain_samples_per_cpu_s']}", f"{r['prepared_samples_per_cpu_s']} ({r['prepared_cpu_ratio']:.2f})",
             f"{r['shuffled_samples_per_cpu_s']} ({r['shuffled_cpu_ratio']:.2f})"] for r in d["summary"]]
    return "\n".join([
        f"`python benchmarks/stream_throughput.py` at {m['created']}, commit `{m['commit'][:7]}`: {m['cpus']} cores, "
        f"torch {m['torch']}, pyarrow {m['pyarrow']}; {s['shards']} shards of {s['per_shard']:,} records, batch "
        f"{s['batch']}, medians of {s['repeat']} rounds.",
        f"Source: {_source(rel)}.", "",
        *_table(["format", "workers", "plain samples/s", "prepared (ratio)", "prepared, shuffled (ratio)",
                 "per CPU-s: plain", "prepared (ratio)", "shuffled (ratio)"], rows)])


# ---- P: the slow-rank check -----------------------------------------------------------------------------------


def straggler_overhead() -> str:
    rel = _latest("straggler-overhead-*.json")
    d = _load(rel)
    rows, windows = [], []
    for s in d["sizes"]:
        low, high = s["paired_ratio_ci95"]
        c_low, c_high = s["control"]["paired_ratio_ci95"]
        share = s["share_of_step"]
        rows.append([f"MLP width {s['width']} ({s['global_batch']}), {s['pairs']:,} pairs",
                     f"{1000 * s['off_median_s']:.2f} ms", f"{s['median_paired_ratio']:.3f} ({low:.3f}-{high:.3f})",
                     f"{s['control']['median_paired_ratio']:.3f} ({c_low:.3f}-{c_high:.3f})",
                     f"{share['own_work']:.2%}",
                     f"{1000 * s['all_reduce_mean_s']:.1f} ms a {s['window_s']:g} s window: {share['all_reduce']:.2%}",
                     f"{s['overhead']:.2%}"])
        named = ", ".join(str(n) for n in s["named"]) or "no rank"
        windows.append(f"{named} named in {s['windows_gathered']} windows at width {s['width']}")
    m, own = d["machine"], d["own_work_one_process"]
    return "\n".join([
        f"`python benchmarks/straggler_overhead.py` at {d['created']}, commit `{d['commit']}`: {m['cores']} cores, "
        f"torch {d['torch']}; load average {', '.join(f'{x:.1f}' for x in m['load_average'])} (1, 5, 15 min) at the "
        "end.",
        f"Source: {_source(rel)}.", "",
        *_table(["model (global batch)", "step, check off", "paired ratio on/off (95%)", "control A A (95%)",
                 "own work, share of a step", "all-reduce, share of a step", "overhead"], rows), "",
        f"The check's own work, measured in one process (width {own['width']}, {own['blocks']} blocks of "
        f"{own['steps_per_block']} steps alternated): {1e6 * own['added_s']:.1f} µs a step. With equal ranks: "
        + "; ".join(windows) + "."])


_EP_CP_MODELS = {"moe": "user MoE decoder (8 listed experts, top-2, width 128, sequence 64), global batch 64",
                 "mixtral": "Hugging Face Mixtral (8 stacked experts, top-2, width 128, sequence 64), global batch 64",
                 "long": "RoPE decoder with SDPA (width 128, sequence 256), global batch 8"}


def ep_cp_overhead() -> str:
    rel = _latest("ep-cp-overhead-*.json")
    d = _load(rel)
    rows = []
    for r in d["results"]:
        ratio = _ratio(r["ratio"], r["ratio_ci"], r["rounds"])
        med = r["median_step_s"]
        rows.append([f"`{r['layout']} 2` / `{r['baseline']} 2`", _EP_CP_MODELS.get(r["model"], r["model"]),
                     f"{1000 * med[r['baseline']]:.1f} ms", f"{1000 * med[r['layout']]:.1f} ms",
                     stats.verdict(ratio)])
    load = ", ".join(f"{x:.1f}" for x in d["load_average"])
    return "\n".join([
        f"`python benchmarks/ep_cp_overhead.py` at {d['created']}: {d['cpus']} cores; load average {load} (1, 5, 15 "
        f"min) at the end; {d['results'][0]['rounds']} rounds A B B A of one `paratrain run` per side, "
        f"{d['results'][0]['steps_per_round']} timed steps each.",
        f"Source: {_source(rel)}.", "",
        *_table(["layout", "model", "step, baseline", "step", "ratio (median of the rounds' paired ratios)"], rows)])


TABLES: dict[str, Callable[[], str]] = {
    "make-bench": make_bench,
    "fault-recovery": fault_recovery,
    "gpt-cpu": gpt_cpu,
    "gpu-gpt": gpu_gpt,
    "limits": limits,
    "nd-overhead": nd_overhead,
    "nd-overhead-ep-cp": nd_overhead_ep_cp,
    "nd-overhead-listed": nd_overhead_listed,
    "compile-cpu": compile_cpu,
    "bench-plan": bench_plan,
    "gpu-compile": gpu_compile,
    "auto-choice": auto_choice,
    "stream-throughput": stream_throughput,
    "straggler-overhead": straggler_overhead,
    "ep-cp-overhead": ep_cp_overhead,
}


def render(text: str) -> str:
    """The doc with every generated block replaced by what its JSON gives now."""
    found = [m["name"] for m in BLOCK.finditer(text)]
    unknown, missing = set(found) - set(TABLES), set(TABLES) - set(found)
    if unknown or missing:
        raise ValueError(f"docs/benchmarks.md: blocks without a generator {sorted(unknown)}, "
                         f"generators without a block {sorted(missing)}")
    return BLOCK.sub(lambda m: f"<!-- generated: {m['name']} -->\n{_make(m['name']).rstrip()}\n"
                               f"<!-- end generated: {m['name']} -->", text)


def _make(name: str) -> str:
    """One table, or an error naming it: a recorded file whose fields changed shows which table reads it."""
    try:
        return TABLES[name]()
    except (KeyError, IndexError, TypeError, ValueError, FileNotFoundError) as e:
        raise ValueError(f"table {name!r} ({TABLES[name].__name__} in benchmarks/docs_tables.py) cannot read its "
                         f"JSON: {type(e).__name__}: {e}") from e


def stale(text: str) -> list[str]:
    """The names of the blocks whose text differs from what their JSON gives, each with a diff."""
    fresh = {m["name"]: m["body"] for m in BLOCK.finditer(render(text))}
    out = []
    for m in BLOCK.finditer(text):
        if m["body"] != fresh[m["name"]]:
            diff = difflib.unified_diff(m["body"].splitlines(), fresh[m["name"]].splitlines(), "doc", "json",
                                        lineterm="", n=0)
            out.append(f"{m['name']}:\n" + "\n".join(diff))
    return out


def record(directory: Path) -> Path:
    """Keep a `make bench` run (results.json and table.md) as benchmarks/results/make-bench-DATE-HHMM/."""
    created = json.loads((directory / "results.json").read_text())["created"]
    target = RESULTS / f"make-bench-{created[:10]}-{created[11:13]}{created[14:16]}"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "table.md"):
        if (directory / name).exists():
            shutil.copyfile(directory / name, target / name)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block differs from what its JSON gives")
    parser.add_argument("--record", type=Path, metavar="DIR", help="keep DIR's `make bench` results first")
    args = parser.parse_args(argv)
    if args.record:
        print(f"kept {record(args.record).relative_to(ROOT)}")
    text = DOC.read_text()
    if args.check:
        problems = stale(text)
        print("\n\n".join(problems) if problems else "docs/benchmarks.md: every generated table matches its JSON")
        return 1 if problems else 0
    fresh = render(text)
    if fresh != text:
        DOC.write_text(fresh)
    print(f"docs/benchmarks.md: {len(TABLES)} tables from benchmarks/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
