#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q tests/gpu --ignore tests/gpu/test_fp8_kernels.py -p no:cacheprovider \
  --timeout 100 -rs > $OUT/other_gpu.txt 2>&1
grep -E "^E |^FAILED|^ERROR|SKIPPED" $OUT/other_gpu.txt | head -20 | cut -c1-300; tail -2 $OUT/other_gpu.txt
timeout 170 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 fp8_block \
  --output $OUT/latency.json > $OUT/latency.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v["prefill_ms"], v.get("fraction_of_own_read_roofline"), v.get("fraction_of_fp8_matmul_peak"))
PY
for a in "" "--quantization fp8 --kv-cache-dtype fp8"; do
  timeout 90 python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc $a \
    --output $OUT/tp$(echo $a | tr -d ' -').json 2>&1 | grep -o '"output_tok_s": [0-9.]*'
done
