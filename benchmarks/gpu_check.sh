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
# what a tree costs on this GPU (tree="auto" decides by it): the shipped target with the n-gram drafter
python -m stree profile --model stree/assets/tiny-target --png "$out/profile_cuda.png" --json \
  > "$out/profile_cuda.json" 2>&1
# the same table without a drafter for the shipped target and a Mamba2-2.7B-width model (bf16, CUDA graphs)
python benchmarks/cost.py --out "$out" 2>&1 | tail -n 40
# Tensor parallelism over NCCL needs two GPUs (the tests cover gloo on the CPU): the tiny target
# split over every GPU, its completion compared with one process's.
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  args=(-m stree generate --model stree/assets/tiny-target --prompt "def f(x):" --max-new-tokens 32
        --drafter stand-det --dtype float32 --json)
  python "${args[@]}" > "$out/tensor_parallel_one.json"
  python -m torch.distributed.run --standalone --nproc-per-node "$gpus" "${args[@]}" \
    | grep '^{' > "$out/tensor_parallel_nccl.json"
  python - "$out" <<'PY'
import json, sys
one, split = (json.load(open(f"{sys.argv[1]}/tensor_parallel_{n}.json")) for n in ("one", "nccl"))
print("tensor parallel over NCCL, token ids identical:", one["token_ids"] == split["token_ids"])
PY
fi
