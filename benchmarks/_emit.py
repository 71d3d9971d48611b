"""The one way the small measurement scripts here report: JSON with its date, on stdout and into the file
named on the command line (what docs/benchmarks.md quotes)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any


def emit(result: dict[str, Any]) -> None:
    out = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **result}
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
