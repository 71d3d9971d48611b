#!/usr/bin/env bash
# The tutorials' ResNet-50 experiment on the GPU(s) here: 3 batches of 120 images of 128x128, MSE on
# one-hot labels, SGD lr 1e-3, 10 repeats; single vs mp (both stages on one GPU when there is one) and
# the tutorials' split_size loop, over the split sizes 120/M; then the AMP bf16 + channels-last fast path.
# Usage (on a machine with CUDA): bash benchmarks/bench_gpu_resnet50.sh OUTDIR
set -u
out=${1:-results/bench-gpu}
py=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
common=(--workload resnet50 --batch-size 120 --image-size 128 --steps 3 --repeat 10 --warmup 2)
$py -m paratrain.cli bench "${common[@]}" --strategies single,dp,mp --microbatches 1,2,3,6,10,12 --out "$out/fp32"
$py -m paratrain.cli bench "${common[@]}" --strategies single,mp --microbatches 1,2,6,10 \
    --precision bf16 --channels-last --out "$out/bf16-cl"
