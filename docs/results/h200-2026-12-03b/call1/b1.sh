#!/bin/bash
# call 1: block kernels' GPU tests, then the block sweep
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv > $OUT/gpu.txt
timeout 200 python3 -m pytest -q -x tests/gpu/test_fp8_kernels.py -k "block or groups" -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests.txt
cat $OUT/tests.txt
timeout 330 python3 benchmarks/fp8_mm.py --block --output $OUT/block.json 2>&1 | tail -60 > $OUT/block.txt
cat $OUT/block.txt
