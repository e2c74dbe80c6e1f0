#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st gather; timeout 150 python3 .lab/u/gather.py > $OUT/gather.txt 2>&1; tail -2 $OUT/gather.txt | tee -a $L
for d in 64,4,2 32,2,2 64,4,2 32,2,2; do
st "tp $d"; DECODE=$d timeout 150 python3 .lab/u/tp_patch.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --inproc --output $OUT/tp-$d-$(date +%s).json > $OUT/tp-$d.txt 2>&1; grep -i "tok/s\|output" $OUT/tp-$d.txt | tail -2 | tee -a $L
done
st done
