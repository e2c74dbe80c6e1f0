#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
st wsbench; timeout 330 python3 .lab/u/wsbench.py > $OUT/wsbench.txt 2>&1; tail -5 $OUT/wsbench.txt | tee -a $L
st latency; timeout 150 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -12 $OUT/latency.txt | tee -a $L
st done
