#!/usr/bin/env bash
# Soak benchmark (not a CI test): ddp, fsdp and pp under `paratrain run --max-restarts` with a worker
# SIGKILLed every 30-90 s and inside run.save, one resume under another layout; see benchmarks/soak.py.
#   bash benchmarks/soak.sh                 # 10 minutes; writes benchmarks/results/soak.json
#   bash benchmarks/soak.sh --minutes 2 --pace 0.2
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python benchmarks/soak.py "$@"
