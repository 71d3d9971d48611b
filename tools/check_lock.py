"""Checks that the environment holds exactly what the lock names: every locked package at its locked version,
and nothing else but paratrain and the installers.

Usage: python tools/check_lock.py requirements.lock   (exit 1 with each difference and the fix)

`make setup` installs the lock and `make test` runs this first, so a suite that passed here passed on the
versions the lock names, whatever the package index offers the day a fresh clone is made.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

UNLOCKED = {"paratrain", "pip", "uv", "wheel"}
"""Installed but not locked: the project itself and the tools that install (uv's version is the Makefile's)."""


def read_lock(path: Path) -> dict[str, Requirement]:
    """Name -> pinned requirement, for every `name==version` line (comments and blank lines skipped)."""
    pins: dict[str, Requirement] = {}
    for line in path.read_text().splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        if not any(spec.operator == "==" for spec in req.specifier):
            raise SystemExit(f"{path}: {line!r} is not pinned to one version (name==version)")
        pins[canonicalize_name(req.name)] = req
    return pins


def differences(pins: dict[str, Requirement], installed: dict[str, str]) -> list[str]:
    """Each way the installed set (name -> version) differs from the lock, one line each."""
    out = []
    for name, req in sorted(pins.items()):
        if name not in installed:
            out.append(f"{name}: locked {req.specifier}, not installed")
        elif not req.specifier.contains(installed[name], prereleases=True):
            out.append(f"{name}: locked {req.specifier}, installed {installed[name]}")
    out += [f"{name}: installed {version}, not in the lock" for name, version in sorted(installed.items())
            if name not in pins and name not in UNLOCKED]
    return out


def installed_now() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def main(argv: list[str]) -> int:
    lock = Path(argv[1] if len(argv) > 1 else "requirements.lock")
    found = differences(read_lock(lock), installed_now())
    if found:
        print(f"the environment differs from {lock}:\n  " + "\n  ".join(found) +
              "\nfix: `make clean setup` (a fresh .venv from the lock); after changing pyproject.toml's ranges on "
              "purpose, `make lock` first", file=sys.stderr)
        return 1
    print(f"{len(read_lock(lock))} packages as {lock} locks them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
