#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 40 python3 docs/results/h200-2026-12-03c/call2/probe16.py 2>&1 | tee $OUT/probe16.txt | cut -c1-300
timeout 200 python3 -m pytest -v tests/gpu/test_fp8_kernels.py -p no:cacheprovider --timeout 90 --durations=12 -k "block_kernels_matches or hand_over or cache_on_the_triton or cuda_graphs_capture or cache_write" > $OUT/t1.txt 2>&1
grep -E "PASSED|FAILED|ERROR" $OUT/t1.txt | grep "::" | cut -c1-200; grep -E "^E " $OUT/t1.txt | head -30 | cut -c1-300; tail -16 $OUT/t1.txt | cut -c1-250
echo "t=$SECONDS"
timeout $((560 - SECONDS)) python3 -m pytest -q tests/gpu/test_fp8_kernels.py -p no:cacheprovider --timeout 60 -k "not (block_kernels_matches or hand_over or cache_on_the_triton or cuda_graphs_capture or cache_write)" > $OUT/t2.txt 2>&1
grep -E "^E |^FAILED" $OUT/t2.txt | head -10 | cut -c1-300; tail -3 $OUT/t2.txt | cut -c1-250
echo "t=$SECONDS"
