#!/usr/bin/env bash
# The GPU checks a lent machine runs in one go (docs/benchmarks.md section L, docs/plan.md "On a GPU"):
#   1. the planner calibrated on the GPU and validated there: `paratrain plan --cluster local --validate` for the
#      gpt workload (GPT-2 small) in fp32 and bf16 and for ResNet-50 (the tutorials' 120 images of 128x128);
#   2. the gpt workload with bf16 and torch.compile, paratrain against the nanoGPT-style hand-written loop;
#   3. the whole CPU suite, unchanged, on the cores the GPU jobs leave (it hides the GPU itself: tests/conftest.py).
# 1-2 run one after the other on cores 0-3; 3 runs beside them on the rest.
# Usage (repository root, a machine with CUDA and paratrain installed):
#   bash benchmarks/gpu_checks.sh OUTDIR [PARTS]     PARTS: any of suite,plan,bench (default all three)
set -u
out=${1:-results/gpu-checks}
parts=${2:-suite,plan,bench}
want() { [[ ",$parts," == *",$1,"* ]]; }
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cores=$(nproc)
pin() { if command -v taskset > /dev/null && [ "$cores" -ge 8 ]; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }

suite_workers=$(( cores >= 8 ? cores - 6 : 2 ))
suite=
want suite && ( pin 4-$((cores - 1)) timeout "${SUITE_TIMEOUT_S:-480}" $py -m pytest -v -n "$suite_workers" --dist loadscope \
    -p no:cacheprovider -rfE --tb=short > "$out/cpu-suite.log" 2>&1
  echo "pytest exit $?" >> "$out/cpu-suite.log" ) &
want suite && suite=$!

gpu() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  pin 0-3 timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/summary.txt" 2>&1
$py -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" >> "$out/summary.txt" 2>&1
want plan && gpu plan-gpt-fp32 150 $py -m paratrain.cli plan --workload gpt --cluster local --validate --out "$out/plan-gpt-fp32"
want plan && gpu plan-gpt-bf16 120 $py -m paratrain.cli plan --workload gpt --cluster local --precision bf16 --validate \
  --out "$out/plan-gpt-bf16"
want plan && gpu plan-resnet50 150 $py -m paratrain.cli plan --workload resnet50 --cluster local --validate \
  --out "$out/plan-resnet50"
want bench && gpu bench-gpt-bf16-compile "${BENCH_TIMEOUT_S:-300}" $py -m paratrain.cli bench --workload gpt --strategies single,ddp \
  --workers 1 --precision bf16 --compile --out "$out/bench-gpt-bf16-compile"
if [ -n "$suite" ]; then wait "$suite"; tail -n 40 "$out/cpu-suite.log" >> "$out/summary.txt"; fi
