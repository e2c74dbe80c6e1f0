#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 .lab/l/probe2.py > $OUT/probe2.txt 2>&1; cat $OUT/probe2.txt
timeout 150 python3 -m pytest -q tests/gpu/test_fp8_kernels.py -k "block or groups" -p no:cacheprovider 2>&1 | tail -15 > $OUT/tests.txt
cat $OUT/tests.txt
timeout 150 python3 benchmarks/fp8_mm.py --block --tokens 1 16 64 256 2048 --output $OUT/block.json 2>&1 | tail -40 > $OUT/block.txt
cat $OUT/block.txt
timeout 230 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 fp8_block --output $OUT/latency.json > $OUT/latency.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v["prefill_ms"], v.get("fraction_of_own_read_roofline"), v["weight_bytes"])
PY
