#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st cfgs2; timeout 400 python3 .lab/s/cfgs2.py $OUT/cfgs2.json 2>&1 | grep "^{\|Error\|error" | tee -a $L
st done
