#!/usr/bin/env bash
# GPU checks of the foundation: dp and ddp(nccl) on the GPU reach the single-GPU weights.
# Usage (on a machine with CUDA): bash benchmarks/gpu_foundation.sh OUTDIR
set -u
out=${1:-results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
$py -m paratrain.cli doctor | tee "$out/doctor.txt"
$py examples/toy.py --strategy single --save-weights "$out/single.pt" | tee "$out/single.txt"
$py examples/toy.py --strategy dp --save-weights "$out/dp.pt" | tee "$out/dp.txt"
$py -m paratrain.cli run examples/toy.py --strategy ddp --save-weights "$out/ddp.pt" 2>&1 | tee "$out/ddp.txt"
$py -m paratrain.cli run --nproc 2 examples/toy.py 2>&1 | tail -3 | tee "$out/too_many.txt"
$py - "$out" <<'PY' | tee "$out/compare.txt"
import sys, torch
out = sys.argv[1]
ref = torch.load(f"{out}/single.pt")
for name in ("dp", "ddp"):
    other = torch.load(f"{out}/{name}.pt")
    diff = max((ref[k].float() - other[k].float()).abs().max().item() for k in ref)
    print(f"{name} vs single on GPU: max abs weight difference {diff:.3e}")
PY
