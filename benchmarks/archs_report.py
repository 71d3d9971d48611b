"""The architecture sweep's results (benchmarks/archs_sweep.py) as Markdown: architecture x layout, each cell
`match`, `refused: <reason>`, `differs: ...` or `FAIL: <what>`, with how many architectures train under each
layout; and the same table written into docs/parallelism.md between its marker comments, so the doc quotes one
named run.

    python benchmarks/archs_report.py benchmarks/results/archs-2026-11-29.json           # print the Markdown
    python benchmarks/archs_report.py benchmarks/results/archs-2026-11-29.json --docs    # and write the doc's section
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "parallelism.md"
BEGIN = "<!-- architecture table: written by benchmarks/archs_report.py, do not edit by hand -->"
END = "<!-- end of architecture table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _layouts(verdicts: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(v["layout"] for v in verdicts))


def table(verdicts: list[dict[str, Any]], first: str = "architecture") -> list[str]:
    """Rows of architecture x layout, then the share of architectures that match under each layout."""
    layouts = _layouts(verdicts)
    by_cell = {(v["arch"], v["layout"]): v for v in verdicts}
    archs = list(dict.fromkeys(v["arch"] for v in verdicts))
    lines = [f"| {first} | " + " | ".join(layouts) + " |", "| --- |" + " --- |" * len(layouts)]
    for arch in archs:
        row = []
        for layout in layouts:
            v = by_cell.get((arch, layout))
            text = "" if v is None else v["short"]
            if v is not None and v["status"] == "match" and v.get("strategy") and layout == "auto":
                text += f" ({v['strategy']})"
            row.append(_cell(text))
        lines.append(f"| {arch} | " + " | ".join(row) + " |")
    shares = []
    for layout in layouts:
        column = [v for v in verdicts if v["layout"] == layout]
        matched = sum(v["status"] == "match" for v in column)
        shares.append(f"**{matched}/{len(column)}** ({100 * matched / max(1, len(column)):.0f}%)")
    lines.append("| trains like the plain loop | " + " | ".join(shares) + " |")
    return lines


def counts(verdicts: list[dict[str, Any]]) -> list[str]:
    """Per layout: how many cells match, are refused, differ (randomness outside the rule) and fail."""
    layouts = _layouts(verdicts)
    lines = ["| layout | match | refused | differs | FAIL |", "| --- | --- | --- | --- | --- |"]
    for layout in layouts:
        tally = Counter(v["status"] for v in verdicts if v["layout"] == layout)
        lines.append(f"| {layout} | {tally['match']} | {tally['refused']} | {tally['differs']} | {tally['FAIL']} |")
    return lines


def reasons(verdicts: list[dict[str, Any]], top: int = 12) -> list[str]:
    """The most frequent refusals and failures, by their short text."""
    tally = Counter(v["short"] for v in verdicts if v["status"] != "match")
    return [f"- {n} x `{_cell(text)}`" for text, n in tally.most_common(top)]


def summary(results: dict[str, Any]) -> list[str]:
    seconds = results["seconds"]
    named, lms = results["named"], results["lms"]
    lines = [f"Run of {results['created']} on {results['machine']} (torch {results['torch']}, transformers "
             f"{results['transformers']}, torchvision {results['torchvision']}, commit {results['commit']}): "
             f"{len({v['arch'] for v in named})} named architectures x {len(_layouts(named))} layouts in "
             f"{seconds['named']:.0f} s"]
    if results["probed"]:
        lines[0] += (f"; {len(results['probed'])} causal LMs of transformers probed, "
                     f"{len({v['arch'] for v in lms})} built and trained under {len(_layouts(lms))} layouts in "
                     f"{seconds['lms']:.0f} s (probing {seconds['probe']:.0f} s)")
    lines[0] += f"; {seconds['total'] / 60:.1f} min in all."
    return lines


def markdown(results: dict[str, Any], full: bool = True) -> str:
    """The whole report; `full=False` leaves out the per-model causal-LM rows (the doc keeps their counts)."""
    out = summary(results) + ["", "Named architectures (tests/zoo/archs.py), each as its library builds it:", ""]
    out += table(results["named"])
    lms = results["lms"]
    if lms:
        out += ["", "Every causal LM of the installed transformers that builds from a tiny config and steps in the "
                "plain loop (tests/zoo/causal_lms.py), per layout:", ""]
        out += counts(lms)
        out += ["", "Most frequent outcomes other than a match:", ""] + reasons(lms)
        if full:
            out += ["", ""] + table(lms, first="model_type")
    unbuilt = {name: p["reason"] for name, p in results["probed"].items() if p["reason"]}
    if unbuilt and full:
        out += ["", f"Not trained ({len(unbuilt)} of {len(results['probed'])}): no tiny model or no plain step", "",
                "| model_type | reason |", "| --- | --- |"]
        out += [f"| {name} | {_cell(reason)} |" for name, reason in sorted(unbuilt.items())]
    elif unbuilt:
        kinds = Counter(re.split(r"[:(]", reason)[0].strip() for reason in unbuilt.values())
        out += ["", f"Not trained ({len(unbuilt)} of {len(results['probed'])}, no tiny model or no plain step): "
                + ", ".join(f"{n} at {kind}" for kind, n in kinds.most_common()) + "."]
    return "\n".join(out) + "\n"


def write_docs(section: str, doc: Path = DOC) -> None:
    """Replace what lies between the doc's BEGIN and END markers with `section`."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: the markers are missing; put these two lines where the table belongs:\n"
                         f"{BEGIN}\n{END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{section.rstrip()}\n{END}{tail}")


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python benchmarks/archs_report.py RESULTS.json [--docs]")
    results = json.loads(Path(argv[0]).read_text())
    print(markdown(results), end="")
    if "--docs" in argv[1:]:
        write_docs(markdown(results, full=False))


if __name__ == "__main__":
    main(sys.argv[1:])
