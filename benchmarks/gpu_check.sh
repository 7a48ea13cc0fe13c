#!/usr/bin/env bash
# Everything a lent GPU should run, in one call of the device tool (its image has torch, triton,
# transformers, pytest and hypothesis but no network, so no install step):
#   bash benchmarks/gpu_check.sh      # writes selfcheck.txt, tests.txt, the sweeps and e2e under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
python -m stree.selfcheck 2>&1 | tee "$out/selfcheck.txt"
python -m pytest -q -p no:cacheprovider tests 2>&1 | tail -n 30 | tee "$out/tests.txt"
python benchmarks/tree_scan_sweep.py --out "$out" 2>&1 | tail -n 40
python benchmarks/model_forward.py --out "$out" 2>&1 | tail -n 40
python benchmarks/e2e.py --out "$out" 2>&1 | tail -n 15
