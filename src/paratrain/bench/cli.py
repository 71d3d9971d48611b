"""Flags of `paratrain bench`, mapped onto the runner."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mlp")
    p.add_argument("--out", default="results/bench")


def main(ns: argparse.Namespace) -> int:
    raise SystemExit("paratrain bench: not built yet")
