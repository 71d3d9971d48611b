"""`make test-archs`: every named architecture (tests/zoo ARCHS) under every layout of tests/archs_cells.py, and
every causal LM the installed transformers knows (tests/zoo/causal_lms.py) under ddp, fsdp, tp and pp, each
trained against the plain PyTorch loop. Writes OUT.json (every verdict with its whole message, the probe's
reasons, times, versions, commit) and OUT.md (the table; benchmarks/archs_report.py), and prints the summary.

    python benchmarks/archs_sweep.py --out benchmarks/results/archs-2026-11-29
    python benchmarks/archs_sweep.py --out /tmp/a --archs qwen2,vit --layouts tp,pp --no-lms     # a part of it
    python benchmarks/archs_sweep.py --out /tmp/b --baseline benchmarks/results/archs-2026-11-29.json

With --baseline, a cell that matched in the baseline and does not now is listed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # as every worker computes: the references add in the workers' order
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
WARM = ("torch,torch._dynamo,torch.distributed.pipelining,torch.distributed.fsdp,torch.distributed.tensor.parallel,"
        "paratrain,cloudpickle,transformers,torchvision.models,archs_cells")
"""What the workers' template imports once per sweep, so a launch forks workers instead of importing torch."""


def _machine() -> str:
    from paratrain.bench.schema import machine

    found = machine()
    return f"{found['cpu']}, {found['cores_total']} cores"


def _commit() -> str:
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    return head + ("" if git("diff", "--quiet", "HEAD", "--", "src").returncode == 0 else " with changes to src/")


def regressions(results: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Cells that matched in `baseline` and do not match in `results`."""
    now = {(v["arch"], v["layout"]): v for v in results["named"] + results["lms"]}
    return [f"{arch} / {layout}: was match, now {now[(arch, layout)]['short']}"
            for v in baseline["named"] + baseline["lms"] if v["status"] == "match"
            for arch, layout in [(v["arch"], v["layout"])]
            if (arch, layout) in now and now[(arch, layout)]["status"] != "match"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path without suffix: writes OUT.json and OUT.md")
    parser.add_argument("--archs", help="comma-separated named architectures (default: all)")
    parser.add_argument("--layouts", help="comma-separated layouts of the named ones (default: all)")
    parser.add_argument("--lms", help="comma-separated causal-LM model_types (default: every one transformers has)")
    parser.add_argument("--no-lms", action="store_true", help="only the named architectures")
    parser.add_argument("--limit-s", type=float, default=None, help="seconds a cell may take before it counts as hung")
    parser.add_argument("--baseline", help="an earlier results JSON: exit 1 if a cell that matched there does not")
    parser.add_argument("--docs", action="store_true", help="also write the table into docs/parallelism.md")
    args = parser.parse_args()

    os.environ.setdefault("PARATRAIN_WARM_WORKERS", WARM)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="paratrain-archs-traces-") as traces:
        os.environ.setdefault("PARATRAIN_TEST_TRACE_CACHE", traces)  # a model's graph traced once, for pp and ddp+pp
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The sweep, its files and the comparison with a baseline; exit status."""
    import torch
    import torchvision
    import transformers
    import zoo
    from archs_cells import LAYOUTS, LIMIT_S, LM_LAYOUTS
    from archs_report import markdown, write_docs
    from archs_verdicts import sweep
    from zoo import causal_lms

    torch.set_num_threads(1)
    limit = args.limit_s or LIMIT_S
    start = time.monotonic()
    named = {n: zoo.ARCHS[n] for n in (args.archs.split(",") if args.archs else zoo.ARCHS)}
    layouts = args.layouts.split(",") if args.layouts else [layout.name for layout in LAYOUTS]
    verdicts_named = sweep(named, layouts, limit, verbose=True)
    named_s = time.monotonic() - start

    probed: dict[str, Any] = {}
    verdicts_lms: list[Any] = []
    probe_s = lms_s = 0.0
    if not args.no_lms:
        begun = time.monotonic()
        found = causal_lms.survey(args.lms.split(",") if args.lms else None)
        probe_s = time.monotonic() - begun
        probed = {name: {"class": p.model_class, "reason": p.reason} for name, p in found.items()}
        print(f"causal LMs: {sum(p.case is not None for p in found.values())} of {len(found)} build and step",
              file=sys.stderr, flush=True)
        begun = time.monotonic()
        cases = {name: p.case for name, p in found.items() if p.case is not None}
        verdicts_lms = sweep(cases, LM_LAYOUTS, limit, verbose=True)
        lms_s = time.monotonic() - begun

    results = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "torchvision": torchvision.__version__, "commit": _commit(), "command": " ".join(sys.argv),
        "limit_s": limit,
        "seconds": {"named": named_s, "probe": probe_s, "lms": lms_s, "total": time.monotonic() - start},
        "named": [v.as_dict() for v in verdicts_named], "lms": [v.as_dict() for v in verdicts_lms],
        "probed": probed,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    report = markdown(results)
    out.with_suffix(".md").write_text(report)
    print(report)
    if args.docs:
        write_docs(markdown(results, full=False))
    if args.baseline:
        lost = regressions(results, json.loads(Path(args.baseline).read_text()))
        print("\n".join(["cells that matched in the baseline and no longer do:", *lost] if lost
                        else ["no cell that matched in the baseline stopped matching"]))
        return 1 if lost else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
