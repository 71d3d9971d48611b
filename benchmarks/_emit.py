"""The one way the small measurement scripts here report: JSON with its date, on stdout and into the file
named on the command line (what docs/benchmarks.md quotes)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def emit(result: dict[str, Any]) -> None:
    out = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **result}
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


def commit() -> str:
    """The checkout's short commit, which a result names so it can be traced to its code ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
