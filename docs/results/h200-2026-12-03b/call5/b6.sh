#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q tests/gpu/test_fp8_kernels.py -p no:cacheprovider > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt; grep -E "^(FAILED|E  )" $OUT/tests.txt | head -10
timeout 40 python3 benchmarks/fp8_mm.py --block --tokens 1 --block-sweep-rows 0 --output $OUT/block.json 2>&1 | grep -E "M=" > $OUT/block.txt; cat $OUT/block.txt
timeout 130 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 fp8_block --output $OUT/latency.json > $OUT/latency.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v["prefill_ms"], v["prefill_TFLOPs"], v.get("fraction_of_own_read_roofline"), v["weight_bytes"])
PY
for q in "" "--checkpoint fp8-block"; do
  timeout 75 python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc $q --output $OUT/tp${q:+-block}.json 2>&1 | grep output_tok_s | cut -c1-300
done
