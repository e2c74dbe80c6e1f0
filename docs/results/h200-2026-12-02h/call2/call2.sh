#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st wsbench; timeout 400 python3 .lab/u/wsbench.py > $OUT/wsbench.txt 2>&1; tail -3 $OUT/wsbench.txt | tee -a $L
st done
