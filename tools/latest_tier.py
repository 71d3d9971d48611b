"""`make test-latest`: the quick tier and the architecture cells on the newest releases, written down with the
versions they ran on.

Usage: python tools/latest_tier.py --out benchmarks/results/latest-DATE.md   (run by the environment under test)

The report names every release the project leans on (torch, transformers, peft, datasets, ...) beside the
pytest result of each part, so a failure reads as "this part fails on transformers X.Y", and README's development
table can quote the last run with its date.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ["torch", "torchvision", "transformers", "peft", "datasets", "pyarrow", "accelerate", "safetensors",
           "numpy"]
"""The releases whose behaviour the project relies on (configs, attention paths, pipelining, DTensor)."""

PARTS = {
    "quick tier": ["-m", "quick", "-n", "2"],
    "architecture cells": ["-m", "slow", "-n", "0",
                           "tests/test_architectures.py::test_ci_cells_match_or_are_refused_by_name"],
}


def versions() -> dict[str, str]:
    out = {}
    for name in WATCHED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run_part(args: list[str]) -> tuple[int, str]:
    """pytest's exit status and its closing line ("12 passed, 1 failed in 80s")."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    closing = [line for line in proc.stdout.splitlines() if re.search(r"\b(passed|failed|error)\b", line)]
    return proc.returncode, (closing[-1].strip("= ") if closing else f"exit {proc.returncode}, no summary")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    found = versions()
    print("newest releases: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    results = {name: run_part(part) for name, part in PARTS.items()}
    failed = [name for name, (code, _) in results.items() if code != 0]
    lines = [f"# make test-latest, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ}", "",
             "| package | version |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in found.items()], "",
             "| part | result |", "| --- | --- |", *[f"| {k} | {v} |" for k, (_, v) in results.items()], "",
             f"verdict: {'FAILED: ' + ', '.join(failed) if failed else 'passed'}", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
