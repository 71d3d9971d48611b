#!/usr/bin/env bash
# The CPU-worker benchmark quoted in docs/benchmarks.md: single, ddp and pp on 2 one-thread workers,
# with the hand-written PyTorch references, on the compute-bound `mlp` workload.
# On a machine with more than 2 cores it pins the run to two physical cores, so it is the 2-core run.
# Usage: [CORES=a,b] bash benchmarks/bench_cpu.sh OUTDIR [extra paratrain bench flags]
set -eu
out=${1:-results/bench-cpu}
shift || true
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export CUDA_VISIBLE_DEVICES=""  # CPU workers even where GPUs exist
pin=()
if [ -n "${CORES:-}" ]; then
  pin=(taskset -c "$CORES")  # e.g. CORES=0,8 to choose the two cores yourself
  echo "pinned to CPUs $CORES"
elif [ "$(nproc)" -gt 2 ] && command -v taskset >/dev/null; then
  cores=$($py - <<'PY'
import glob, re
seen, cpus = set(), []
for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/core_id"),
                   key=lambda p: int(re.search(r"cpu(\d+)/", p).group(1))):
    cpu = int(re.search(r"cpu(\d+)/", path).group(1))
    core = (open(path.replace("core_id", "physical_package_id")).read(), open(path).read())
    if core not in seen:
        seen.add(core)
        cpus.append(cpu)
print(",".join(map(str, cpus[:2])))
PY
)
  pin=(taskset -c "$cores")
  echo "pinned to CPUs $cores (two physical cores)"
fi
start=$(date +%s)
"${pin[@]}" $py -m paratrain.cli bench --out "$out" "$@"
echo "bench wall time: $(( $(date +%s) - start )) s"
