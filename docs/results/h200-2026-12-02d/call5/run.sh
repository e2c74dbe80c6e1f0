#!/bin/bash
# device call 5, on the committed code: GPU tests, throughput and latency beside bf16
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
git log --oneline -1 >> $L
st tests; timeout 170 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_fp8_kernels.py tests/unit/test_attention.py -k fp8 > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
st tp-bf16; python3 benchmarks/throughput.py --shape llama-3.1-8b --output $OUT/tp-bf16.json >> $L 2>&1
st tp-fp8; python3 benchmarks/throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --output $OUT/tp-fp8.json >> $L 2>&1
st latency; python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 fp8_fp32_accumulation --profile-prefill --output $OUT/latency.json >> $L 2>&1
st done
python3 -c "
import json
for f in ('tp-bf16', 'tp-fp8'):
    print(f, json.load(open('$OUT/' + f + '.json'))['baton']['output_tok_s'])
d = json.load(open('$OUT/latency.json'))
for v in d['variants']:
    print(v['variant'], v['decode_ms_per_step'], v['prefill_ms'], round(sum(r['us_per_step'] for r in v['prefill_kernels']) / 1e3, 2))
"
