"""The lock (`requirements.lock`) and its check (`tools/check_lock.py`): what CI and `make setup` install is one
version of each package, and an environment that drifted from it is named package by package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_lock", ROOT / "tools" / "check_lock.py")
assert _spec and _spec.loader
check_lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lock)


def test_the_lock_pins_every_package_the_project_names_within_its_range() -> None:
    pins = check_lock.read_lock(ROOT / "requirements.lock")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in requirements.lock: run `make lock`"
        (pinned,) = [s.version for s in pins[name].specifier if s.operator == "=="]
        assert req.specifier.contains(pinned, prereleases=True), (req, pinned)


def test_each_difference_is_named() -> None:
    pins = {"torch": Requirement("torch==2.14.1"), "peft": Requirement("peft==0.21.2"),
            "numpy": Requirement("numpy==2.4.6")}
    installed = {"torch": "2.14.1+cu130", "peft": "0.22.0", "rich": "15.0.0", "paratrain": "0.1.0", "uv": "0.13.9"}
    assert check_lock.differences(pins, installed) == [
        "numpy: locked ==2.4.6, not installed", "peft: locked ==0.21.2, installed 0.22.0",
        "rich: installed 15.0.0, not in the lock"]
    assert check_lock.differences(pins, {"torch": "2.14.1", "peft": "0.21.2", "numpy": "2.4.6", "uv": "1"}) == []


def test_a_range_in_the_lock_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("# comment\ntorch==2.14.1\ntransformers>=5\n")
    try:
        check_lock.read_lock(lock)
    except SystemExit as err:
        assert "'transformers>=5' is not pinned" in str(err)
    else:
        raise AssertionError("a range was accepted as a lock line")
