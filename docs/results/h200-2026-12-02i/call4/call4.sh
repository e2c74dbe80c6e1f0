#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st "bf16 32"
timeout 100 python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc --max-num-seqs 32 --num-prompts 96 --step-trace --output $OUT/tp-bf16-32.json > /tmp/run.txt 2>&1
grep -o '"output_tok_s": [0-9.]*' /tmp/run.txt | head -1 | tee -a $L
st "gpu tests"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu-tests.txt 2>&1
tail -8 $OUT/gpu-tests.txt | tee -a $L
st done
