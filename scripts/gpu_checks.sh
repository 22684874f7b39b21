#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU, in one call: the serving engine's paged path and the Pallas
# kernels' tests on the GPU (in the background, a small share of its memory), and the paged-attention sweep.
#     OUT=/some/dir bash scripts/gpu_checks.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

pytest="python3 -m pytest -o addopts= -p no:cacheprovider -q --durations=8"
(export XLA_PYTHON_CLIENT_MEM_FRACTION=0.04
 timeout 200 $pytest -n 2 -m gpu tests/pallas_kernels >"$OUT/tests.txt" 2>&1; echo "kernel tests exit $?" >>"$OUT/tests.txt"
 timeout 330 $pytest -n 4 --dist loadscope -m "" tests/models/test_paged_kv.py tests/jspec/serve/test_paged.py \
     tests/jspec/serve/test_paged_scheduler.py tests/jspec/serve/test_slots.py \
     -k "paged or pool or long_prompt or greedy or crowd or cached" >>"$OUT/tests.txt" 2>&1
 echo "serve tests exit $?" >>"$OUT/tests.txt") &
tests=$!

XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 300 python3 scripts/bench_kernels.py --kernel paged \
    --out "$OUT/paged_attention.json" 2>&1 | tee "$OUT/paged_attention.txt"

wait $tests
grep -E "passed|failed|error|exit|FAILED|Error" "$OUT/tests.txt" | tail -40
