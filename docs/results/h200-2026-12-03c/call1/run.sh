#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
timeout 330 python3 -m pytest -q tests/gpu/test_fp8_kernels.py -p no:cacheprovider -rs --durations=15 > $OUT/tests.txt 2>&1
tail -25 $OUT/tests.txt; grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head -20
timeout 60 python3 -m pytest -q tests/unit/test_attention.py -k fp8 -p no:cacheprovider > $OUT/attn.txt 2>&1; tail -3 $OUT/attn.txt
timeout 40 python3 benchmarks/fp8_mm.py --block --tokens 1 --block-sweep-rows 0 --output $OUT/block.json 2>&1 | grep -E "M=" > $OUT/block.txt; cat $OUT/block.txt
timeout 90 python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc --checkpoint fp8-block --kv-cache-dtype fp8 --output $OUT/tp-block-fp8kv.json 2>&1 | grep output_tok_s | cut -c1-300
