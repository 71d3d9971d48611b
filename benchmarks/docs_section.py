"""Turn one `paratrain bench` output directory into a section of docs/benchmarks.md.

Copies the run's plots to docs/img/NAME-*.png and prints Markdown (date, machine, command, commit,
table, summary, the issue's targets against what was measured) to paste into the doc, so the figures
quoted there always come from one named run.

    python benchmarks/docs_section.py results/bench cpu > /tmp/section.md
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from paratrain.bench import report, schema

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (("ddp", 1.7, "ddp on 2 workers >= 1.7x single"), ("pp", 1.5, "2-stage pp >= 1.5x single"))


def _best(runs: list[dict], strategy: str, workers: int) -> dict | None:
    ok = [r for r in runs if r["strategy"] == strategy and r["workers"] == workers and r["status"] == "ok"]
    return min(ok, key=lambda r: r["median_step_s"]) if ok else None


def targets(runs: list[dict]) -> list[str]:
    lines = []
    for strategy, goal, text in TARGETS:
        best = _best(runs, strategy, 2)
        if best is None or best["speedup_vs_single"] is None:
            lines.append(f"- {text}: not measured in this run")
            continue
        verdict = "met" if best["speedup_vs_single"] >= goal else "NOT met"
        m = f" (M={best['microbatches']})" if best["microbatches"] is not None else ""
        lines.append(f"- {text}: {best['speedup_vs_single']:.2f}x{m}, {verdict}")
    ratios = [r for r in runs if r["vs_reference"] is not None]
    if ratios:
        worst = max(ratios, key=lambda r: r["vs_reference"])
        m = f" M={worst['microbatches']}" if worst["microbatches"] is not None else ""
        verdict = "met" if worst["vs_reference"] <= 1.02 else "NOT met"
        pairs = ", ".join(f"{r['strategy']}{' M=' + str(r['microbatches']) if r['microbatches'] else ''} "
                          f"{r['vs_reference']:.3f}" for r in ratios)
        lines.append(f"- paratrain / hand-written <= 1.02: worst {worst['strategy']}{m} {worst['vs_reference']:.3f}, "
                     f"{verdict} (all: {pairs})")
    return lines


def main(directory: str, name: str) -> None:
    src = Path(directory)
    results = json.loads((src / "results.json").read_text())
    typed = schema.from_json(results)["runs"]
    images = ROOT / "docs" / "img"
    images.mkdir(parents=True, exist_ok=True)
    copied = []
    for png in sorted(src.glob("*.png")):
        target = images / f"{name}-{png.name}"
        shutil.copyfile(png, target)
        copied.append(target.relative_to(ROOT / "docs"))
    m = results["machine"]
    gpus = ", ".join(m["gpus"]) or "none"
    print(f"- date: {results['created']}")
    print(f"- machine: {m['cpu']}, {m['cores']} core(s) used of {m.get('cores_total', m['cores'])}; GPUs: {gpus}; "
          f"torch {m['torch']}, Python {m['python']}")
    print(f"- commit: {results['paratrain'].get('commit')}")
    print(f"- command: `{results['command']}`")
    print(f"- workload: {results['workload']['description']}, {results['workload']['parameters'] / 1e6:.1f} M "
          f"parameters, global batch {results['global_batch']}")
    print()
    print(report.markdown(typed))
    print()
    print("\n".join(f"- {line}" for line in report.summary(typed)))
    print()
    print("Targets (ratios from this one run):")
    print("\n".join(targets(results["runs"])))
    print()
    for path in copied:
        print(f"![{path.stem}]({path})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/docs_section.py RESULTS_DIR NAME")
    main(sys.argv[1], sys.argv[2])
