#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st gpu-tests; timeout 330 python3 -m pytest -p no:cacheprovider -q tests/gpu > $OUT/tests-gpu.txt 2>&1; tail -4 $OUT/tests-gpu.txt | tee -a $L
st sweep; timeout 150 python3 benchmarks/attention_sweep.py --batch 64 --min-ctx 1000 --max-ctx 4000 --heads 32 --kv-heads 8 --layers 32 --kv-cache-dtypes auto fp8 --rounds 1 --output $OUT/sweep-64.json > $OUT/sweep-64.txt 2>&1; tail -3 $OUT/sweep-64.txt | tee -a $L
st done
