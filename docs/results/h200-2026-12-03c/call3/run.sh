#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m pytest -v tests/gpu/test_fp8_kernels.py -p no:cacheprovider --timeout 50 -k "block_kernels_matches and float16" > $OUT/t16.txt 2>&1
grep -E "PASSED|FAILED" $OUT/t16.txt | grep "::" | cut -c1-200; grep -E "^E " $OUT/t16.txt | head -8 | cut -c1-300; tail -1 $OUT/t16.txt
echo "t=$SECONDS"
timeout 150 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 fp8_block --output $OUT/latency.json > $OUT/latency.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v["prefill_ms"], v["prefill_TFLOPs"], v.get("fraction_of_own_read_roofline"), v["weight_bytes"])
PY
echo "t=$SECONDS"
for q in "--checkpoint fp8-block" ""; do
  timeout 90 python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc $q --output $OUT/tp${q:+-block}.json 2>&1 | grep output_tok_s | cut -c1-200
  echo "t=$SECONDS"
done
