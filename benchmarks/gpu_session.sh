#!/usr/bin/env bash
# The multi-GPU runs that README.md "Not done" lists, in one go, on a machine with 2 or more GPUs:
#
#   bash benchmarks/gpu_session.sh [out_dir]        # default out_dir: benchmarks/results/raw
#
# Stages, each under its own limit in seconds (environment): the tests marked multigpu (MG_S,
# default 300), the end-to-end tests on CUDA (E2E_S, 240), bench_e2e.py --profile at TP=2 (BENCH_S, 600;
# TOKENS, MODES, VARIANTS, LAYERS pick the grid; BENCH_FLAGS adds flags, e.g. --deterministic,
# --static-scales (a checkpoint's static activation scales) or --family qwen2 --hidden 3584 --heads 28
# --kv-heads 4 --ffn 18944 (another model family and shape).
# pytest gets SIGINT at its limit, so it still reports which tests failed; bench_e2e rewrites out_dir/e2e_partial.json after every token count.
# The randomized differential check of the passes on NCCL (stage fuzz, FUZZ_S, 300; FUZZ_CASES, 8;
# FUZZ_SEED, 0) runs when STAGES names it; it reruns a differing case as its two controls (the tested
# model compiled as the reference; both without fp4fuse), 1-2 minutes more per difference.
# STAGES (default "tests e2e bench") picks stages, so that a device call's time limit can split them.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
set -uo pipefail
out="${1:-benchmarks/results/raw}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH="${PYTHONPATH:-.}"
stage() { echo "=== $1 ($(date +%T))"; }
wants() { [[ " ${STAGES:-tests e2e bench} " == *" $1 "* ]]; }

if wants tests; then
stage "tests marked multigpu"
timeout -s INT "${MG_S:-300}" python -m pytest -q -rfE -p no:cacheprovider -m multigpu tests 2>&1 | tail -60
fi
if wants e2e; then
stage "end-to-end tests on CUDA (FP4FUSE_E2E_DEVICE=cuda)"
FP4FUSE_E2E_DEVICE=cuda timeout -s INT "${E2E_S:-240}" python -m pytest -q -rfE -p no:cacheprovider tests/e2e 2>&1 | tail -60
fi
if wants bench; then
stage "bench_e2e.py at TP=${TP:-2}"
timeout -s INT "${BENCH_S:-600}" python benchmarks/bench_e2e.py --tp "${TP:-2}" --layers "${LAYERS:-2}" \
  --tokens "${TOKENS:-16,128,1024,8192}" --modes "${MODES:-cudagraphs,default}" \
  --variants "${VARIANTS:-bf16,bf16-fp4fuse,nvfp4,sp,fp4fuse}" --profile ${BENCH_FLAGS:-} \
  --partial "$out/e2e_partial.json" --json "$out/e2e.json" --out "$out/e2e.md" 2>&1 | tail -60
fi
if [[ " ${STAGES:-} " == *" fuzz "* ]]; then
stage "tests/fuzz_fusion.py on CUDA"
PYTHONPATH="$PYTHONPATH:tests" timeout -s INT "${FUZZ_S:-300}" python tests/fuzz_fusion.py --device cuda \
  --cases "${FUZZ_CASES:-8}" --seed "${FUZZ_SEED:-0}" 2>&1 | grep -E '^\{' | tail -60
fi
stage "end"
