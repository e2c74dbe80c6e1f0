#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q tests/unit/test_fused_ops.py tests/gpu/test_gpu_engine.py -p no:cacheprovider \
  --timeout 100 -rs > $OUT/tests.txt 2>&1
grep -E "^E |^FAILED|^ERROR|SKIPPED" $OUT/tests.txt | head -20 | cut -c1-300; tail -2 $OUT/tests.txt
timeout 150 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 \
  --output $OUT/latency.json > $OUT/latency.txt 2>&1
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v["prefill_ms"])
PY
