#!/bin/bash
# session t, call 1: GPU tests on the committed code; greedy argmax timings; 32k batch-16 decode with every run
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st argmax; timeout 60 python3 .lab/t/argmax.py > $OUT/argmax.json 2>$OUT/argmax.err; cat $OUT/argmax.json | tee -a $L; tail -3 $OUT/argmax.err
st tests; timeout 300 python3 -m pytest -p no:cacheprovider -q tests/gpu > $OUT/tests.txt 2>&1; tail -6 $OUT/tests.txt | tee -a $L
st long; timeout 150 python3 benchmarks/long_context.py --variants triton --lengths 2048 --decode-batches 16 1 --decode-steps 64 --output $OUT/long-decode.json > /tmp/lc.txt 2>&1; tail -2 /tmp/lc.txt
python3 -c "
import json
d = json.load(open('$OUT/long-decode.json'))
for r in d['variants'][0]['decode']: print(r)
" | tee -a $L
st done
