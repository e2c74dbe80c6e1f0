#!/bin/bash
# device call 3: fast accumulation in the 2k prefill (alternating, kernel tables); FP8-cache decode launches at two more batch shapes
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st latency; python3 benchmarks/latency.py --shape llama-3.1-8b --variants fp8_fast fp8 fp8_fast fp8 --profile-prefill --output $OUT/latency-ab.json >> $L 2>&1
python3 -c "
import json; d=json.load(open('$OUT/latency-ab.json'))
for v in d['variants']:
    print(v['variant'], v['prefill_ms'], v['decode_ms_per_step'], [(r['kernel'][:60], r['us_per_step'], r['calls_per_step']) for r in v['prefill_kernels'][:6]])
"
st sweep64; python3 benchmarks/attention_sweep.py --batch 64 --min-ctx 1024 --max-ctx 4096 --heads 32 --kv-heads 8 --layers 32 --rounds 1 --kv-cache-dtypes auto fp8 --output $OUT/sweep-64x1k-4k.json >> $L 2>&1
st sweep128; python3 benchmarks/attention_sweep.py --batch 128 --min-ctx 100 --max-ctx 2048 --heads 32 --kv-heads 8 --layers 32 --rounds 1 --kv-cache-dtypes auto fp8 --output $OUT/sweep-128x100-2k.json >> $L 2>&1
st done
