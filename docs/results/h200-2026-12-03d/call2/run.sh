#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 45 python3 .lab/n/silu_warps.py  # (now docs/results/h200-2026-12-03d/call2/silu_warps.py) 2>&1 | tee $OUT/silu_warps.txt | cut -c1-400
# the block and hand-over tests passed in call 1: the rest of the file here
timeout 270 python3 -m pytest -q tests/gpu/test_fp8_kernels.py -p no:cacheprovider --timeout 120 -rs \
  -k "not hand_over and not block" > $OUT/fp8_kernels.txt 2>&1
grep -E "^E |^FAILED|^ERROR" $OUT/fp8_kernels.txt | head -20 | cut -c1-300; tail -2 $OUT/fp8_kernels.txt
timeout 150 python3 -m pytest -q -m gpu tests --ignore tests/gpu/test_fp8_kernels.py -p no:cacheprovider \
  --timeout 100 -rs > $OUT/other_gpu.txt 2>&1
grep -E "^E |^FAILED|^ERROR|SKIPPED" $OUT/other_gpu.txt | head -20 | cut -c1-300; tail -2 $OUT/other_gpu.txt
