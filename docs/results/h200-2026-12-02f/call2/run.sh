#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st lab2; timeout 200 python3 .lab/s/b1attn2.py $OUT/b1attn2.json 2>&1 | grep -v Warn | tee -a $L | tail -30
st cfgs; timeout 340 python3 .lab/s/cfgs.py $OUT/cfgs.json 2>&1 | grep "^{" | tee -a $L
st done
