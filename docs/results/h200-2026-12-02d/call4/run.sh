#!/bin/bash
# device call 4: where the FP8 2k prefill's wall time goes (host profile beside the kernel table)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nproc > $OUT/host.txt; lscpu | grep -E "Model name|MHz" >> $OUT/host.txt
python3 benchmarks/latency.py --shape llama-3.1-8b --variants fp8 fp8_fast graphs --profile-prefill --output $OUT/latency-host.json > $OUT/log.txt 2>&1
python3 -c "
import json; d=json.load(open('$OUT/latency-host.json'))
for v in d['variants']:
    print(v['variant'], v['prefill_ms'], 'gpu', round(sum(r['us_per_step'] for r in v['prefill_kernels'])/1e3,2))
    for r in v['prefill_host'][:14]: print('   ', r)
"
