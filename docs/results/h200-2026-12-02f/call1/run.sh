#!/bin/bash
# session s, call 1: GPU tests on the committed code (StaticTokens mend), batch-1 short-context decode attention lab
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $L
st tests; timeout 260 python3 -m pytest -p no:cacheprovider -q -x tests/gpu > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
st b1attn; timeout 200 python3 .lab/s/b1attn.py $OUT/b1attn.json 2>&1 | grep -v Warn | tee -a $L | tail -20
st done
