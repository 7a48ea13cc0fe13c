#!/usr/bin/env bash
# Everything a lent GPU should run, in two calls of the device tool of at most 10 minutes each (its
# image has torch, triton, transformers, pytest, pytest-xdist and hypothesis but no network: a newer
# package travels as a wheel, below). Every part runs under its own time limit, so a hang costs that
# part alone:
#   bash benchmarks/gpu_check.sh tests   # device, selfcheck, the whole test suite on CUDA, the scan sweep
#   bash benchmarks/gpu_check.sh bench   # model forward, e2e, the cost tables, profile, speculation
#   bash benchmarks/gpu_check.sh core    # a 15-minute lease: one call of under 10 minutes with the
#                                        # selfcheck, the suite, speculation, profile and the traces
# Logs and results are written to /tmp/gpu_check_<part>/ and packed after every part into one file,
# $OUT/gpu_check_<part>.tar.gz (benchmarks/results/ without $OUT): the device tool brings back at
# most 8 files, and a call cut off at its limit still brings back the parts that finished.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:?which part: core, tests or bench}"
base="${OUT:-benchmarks/results}"
out="${TMPDIR:-/tmp}/gpu_check_$part"
rm -rf "$out"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# pytest-xdist workers share 16 cores: one BLAS/OpenMP/numba thread pool each would oversubscribe them
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 NUMBA_NUM_THREADS=2
# The image's transformers may be older than setup.py's floor (5.17 there on 2026-11-25; the tests
# compare against transformers' own models, whose grouped gated norm is right from 5.23 on), and it
# has no math-verify (stree.patterns.answers). transformers 5.25 checks for huggingface_hub >= 2.4 on
# import (the image's: 1.33), which needs httpx2. Carry wheels, then run with carry=[".whl"] (2026-12-04):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 \
#     truststore==0.10.5 hf-xet==1.8.0 kernels==0.19.1 tomlkit==0.15.3 regex==2026.5.9 \
#     math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
if compgen -G ".whl/*.whl" > /dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# step NAME SECONDS CMD...: run CMD under a time limit (SIGNAL, TERM unless set), its output in
# $out/NAME.log; print its status and last lines (the device tool returns the end of the output)
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -s "${SIGNAL:-TERM}" -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tar -czf "$base/gpu_check_$part.tar.gz" -C "$out" .
  echo "== $name: exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo " (time limit $limit s)")"
  tail -n "${TAIL:-6}" "$out/$name.log"
}

# the suite on CUDA; -v names each failure as it happens, so a run cut off at its limit still says
# which. Left out: the torchrun exit tests (gloo on the CPU whatever the machine, minutes of process
# starts; CI runs them).
suite() {
  # SIGINT at the limit: pytest stops and still prints the failures so far with their tracebacks (a
  # run cut off by SIGTERM on 2026-12-04 named 18 failures and showed none of their errors)
  SIGNAL=INT TAIL=3 step tests "$1" python -m pytest -v -n "$2" -p no:cacheprovider --timeout 280 --tb=short -rfE tests \
    --ignore tests/test_tensor_parallel_exit.py
  grep -E "(FAILED|ERROR) tests" "$out/tests.log" | sed 's/.*\(FAILED\|ERROR\) /\1 /' | sort -u | cut -c1-200 | head -n 40
}

# the card, its driver and memory, and the versions of the packages the checks run on
device_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
}
export -f device_info  # (step runs its command under timeout, a new process)

case "$part" in
core)
  step device 20 bash -c device_info
  step selfcheck 60 python -m stree.tools.selfcheck
  # first, what landed since the last GPU and has run on none: the graphed greedy iteration and step,
  # and the packed replay's validation on the tensors' device
  TAIL=12 step graphs 45 python -m pytest -q -p no:cacheprovider --tb=short tests/runtime/test_graphs.py \
    tests/kernels/test_packed.py::test_replay_of_packed_trees_writes_each_trees_own_commit_into_its_slot
  suite 300 14
  TAIL=20 step speculation 110 python benchmarks/speculation.py --device cuda --modes eager \
    --temperatures 0 --batches 1,2 --rounds 1 --out "$out"
  step profile 40 bash -c "python -m stree profile --model stree/assets/tiny-target --png $out/profile_cuda.png --json > $out/profile_cuda.json &&
    python -m stree profile --model stree/assets/tiny-target --batch-size 2 --png $out/profile_cuda_b2.png --json > $out/profile_cuda_b2.json"
  TAIL=24 step iteration_trace 30 python benchmarks/iteration_trace.py --out "$out"
  TAIL=40 step autotree_trace 45 python benchmarks/autotree_trace.py --out "$out"
  ;;
tests)
  step device 30 bash -c device_info
  step selfcheck 120 python -m stree.tools.selfcheck
  # every test: the kernel tests run their Triton kernels on CUDA tensors (conftest sets no
  # interpreter when CUDA is there), and the library's defaults put models on the GPU
  suite 400 12
  step tree_scan_sweep 100 python benchmarks/tree_scan_sweep.py --out "$out"
  ;;
bench)
  # five Mamba2-2.7B-to-8B-width models at 5 forwards each: about 35 s a model on an H100
  step model_forward 200 python benchmarks/model_forward.py --out "$out"
  # where a decoding iteration's time goes (host ops and launches between graph replays)
  TAIL=24 step iteration_trace 60 python benchmarks/iteration_trace.py --out "$out"
  # float32: every configuration's tokens are compared with transformers' (bfloat16 flips near-ties)
  step e2e 150 python benchmarks/e2e.py --dtype float32 --out "$out"
  # what a tree costs on this GPU (tree="auto" decides by it): the shipped target with the n-gram drafter
  step profile 60 bash -c "python -m stree profile --model stree/assets/tiny-target --png $out/profile_cuda.png \
    --json > $out/profile_cuda.json"
  # the same table without a drafter for the shipped target and a Mamba2-2.7B-width model (bf16, CUDA graphs)
  step cost 90 python benchmarks/cost.py --out "$out"
  # the README's text API at default settings against stree's own autoregressive decoding
  TAIL=30 step speculation 170 python benchmarks/speculation.py --device cuda --modes eager \
    --temperatures 0,1.0 --batches 1,2 --out "$out"
  # what tree="auto" does per iteration (plain, probes, trees by size: predicted and clock ms)
  TAIL=40 step autotree_trace 60 python benchmarks/autotree_trace.py --out "$out"
  # each row its own tree size, scored by the packed Triton kernels (no padding computed; eager, as
  # graphs are made per shape), against one size for all rows: off by default from the CPU's numbers
  TAIL=12 step per_row 90 python benchmarks/speculation.py --device cuda --modes eager --no-cuda-graph \
    --temperatures 0 --batches 8 --drafters ngram,stand-det --per-row --rounds 1 --stem speculation_per_row_cuda \
    --out "$out"
  # stree serve on the GPU (issue 34's CUDA serving numbers): throughput and latency under 1-32
  # streaming clients, speculative against autoregressive; last, as the part a long run may lose
  TAIL=14 step serve 100 python benchmarks/serve.py --device cuda --concurrency 1,4,16,32 --requests 4 --out "$out"
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
  ;;
*)
  echo "gpu_check.sh: part must be core, tests or bench, not '$part'" >&2
  exit 2
  ;;
esac
rm -rf "$out"
