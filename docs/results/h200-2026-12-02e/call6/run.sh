#!/bin/bash
# device call 6: piecewise CUDA graphs on the GPU: the test, latency beside graphs, throughput
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
git log --oneline -1 >> $L
st tests; timeout 150 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gpu_engine.py -k "piecewise or graphs" > $OUT/tests.txt 2>&1; tail -15 $OUT/tests.txt
st latency; timeout 300 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs piecewise fp8 fp8_piecewise --profile-prefill --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -5 $OUT/latency.txt
grep -iE "piecewise|captur" $OUT/latency.txt | head
st done
python3 -c "
import json
d = json.load(open('$OUT/latency.json'))
for v in d['variants']:
    print(v['variant'], v['decode_ms_per_step'], v['prefill_ms'], round(sum(r['us_per_step'] for r in v.get('prefill_kernels', [])) / 1e3, 2))
"
