#!/bin/bash
# Call 1 of h200-2026-12-03d on the H200 (carry .carry/whl): the fused
# group codes as committed (pointers built as a tile, wide stores), first on a GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q tests/gpu/test_fp8_kernels.py -p no:cacheprovider --timeout 90 \
  -k "hand_over or block" > $OUT/tests.txt 2>&1
grep -E "^E |^FAILED" $OUT/tests.txt | head -20 | cut -c1-300; tail -2 $OUT/tests.txt
timeout 60 python3 docs/results/h200-2026-12-03c/next/micro.py 2>&1 | tee $OUT/micro.txt | cut -c1-600
timeout 150 python3 benchmarks/latency.py --shape llama-3.1-8b \
  --variants fp8_block_no_codes fp8_block fp8 --output $OUT/latency-ab.json > $OUT/latency-ab.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency-ab.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v["prefill_ms"], v.get("fraction_of_own_read_roofline"))
PY
timeout 90 python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc --checkpoint fp8-block \
  --output $OUT/tp-block.json 2>&1 | grep output_tok_s | cut -c1-200
