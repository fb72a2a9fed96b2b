#!/bin/bash
# What to run first on a machine with a CUDA GPU (about 2 minutes on an H200):
#   bash benchmarks/gpu_check.sh SUBSET [OUT]
# SUBSET: a Flickr8k copy in the official layout (benchmarks/flickr8k_subset.py makes a small one:
# the whole dataset works too, slower). OUT (default ./gpu-check): logs and captions.
# 1. the `cuda` tests and tests/test_gpu_host.py;
# 2. one epoch of the SAT recipe (configs/sat_lite2_flickr8k.toml with epochs = 1) on SUBSET, on the GPU;
# 3. the same recipe for 60 steps under torchrun with one process (--nproc 1: nccl);
# 4. `captionkit caption` of SUBSET's photos with the shipped default on the GPU;
# 5. benchmarks/device_speed.py on the GPU and on this machine's CPU.
# Each step has a time limit and the script goes on after a failure; read the "===" lines.
set -u
SUBSET=${1:?usage: bash benchmarks/gpu_check.sh SUBSET [OUT]}
OUT=${2:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CAPTIONKIT_CACHE=${CAPTIONKIT_CACHE:-$OUT/cache}
T0=$(date +%s); step() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
step "machine"
nvidia-smi -L
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
step "cuda tests"
timeout 300 python3 -m pytest -m cuda tests --continue-on-collection-errors -q -p no:cacheprovider -o addopts="" -rfE > "$OUT/cuda.log" 2>&1
grep -v "^SKIPPED" "$OUT/cuda.log" | tail -30
timeout 120 python3 -m pytest tests/test_gpu_host.py -q -p no:cacheprovider -o addopts="" 2>&1 | tail -3
step "SAT recipe, 1 epoch on $SUBSET"
python3 - "$SUBSET" "$OUT/sat1.toml" <<'PY'
import re, sys
text = open("configs/sat_lite2_flickr8k.toml").read()
text = re.sub(r'(?m)^dataset = .*$', f'dataset = "{sys.argv[1]}"', text)
open(sys.argv[2], "w").write(re.sub(r'(?m)^epochs = \d+', 'epochs = 1', text))
PY
timeout 600 captionkit train --config "$OUT/sat1.toml" --out "$OUT/sat1" --device cuda > "$OUT/sat.log" 2>&1
echo "rc=$?"; tr '\r' '\n' < "$OUT/sat.log" | grep -v "^\s*$" | grep -v "it/s\]$" | tail -8
step "torchrun, one GPU, 60 steps"
timeout 300 captionkit train --config "$OUT/sat1.toml" --out "$OUT/torchrun1" --device cuda --nproc 1 --max-steps 60 \
    > "$OUT/torchrun.log" 2>&1
echo "rc=$?"; tr '\r' '\n' < "$OUT/torchrun.log" | grep -v "^\s*$" | tail -4
step "caption $SUBSET's photos with the shipped default"
timeout 300 captionkit caption "$SUBSET/Flicker8k_Dataset" --device cuda --jsonl "$OUT/captions.jsonl" \
    > /dev/null 2> "$OUT/caption.err"
echo "rc=$?"; tail -2 "$OUT/caption.err"
step "speed: GPU, then this machine's CPU"
timeout 300 python3 benchmarks/device_speed.py --device cuda --images 2000 --batch-size 64 --workers 8 2>&1 | tail -5
timeout 300 python3 benchmarks/device_speed.py --device cpu --images 64 2>&1 | tail -4
step done
