#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st tests; timeout 120 python3 -m pytest -p no:cacheprovider -q tests/unit/test_attention.py -k "longest_first or fp8_cache" > $OUT/tests-attn.txt 2>&1; tail -2 $OUT/tests-attn.txt | tee -a $L
i=0
for v in "triton_fp8kv:" "triton_fp8kv:16,4,2,4,0" "triton_fp8kv:16,4,2,4,2" "triton:" "triton:16,4,2,4,0" "triton_fp8kv:16,4,3,4,1"; do
  i=$((i+1)); var=${v%%:*}; sp=${v#*:}
  st "lc $i $var [$sp]"; SPLIT=$sp timeout 100 python3 .lab/u/lc_patch.py --variants $var --lengths 2048 --decode-batches 1 --decode-steps 64 --repeats 1 --output $OUT/lc$i.json > $OUT/lc$i.txt 2>&1; grep '"batch"' $OUT/lc$i.txt | cut -c1-200 | tee -a $L
done
st done
