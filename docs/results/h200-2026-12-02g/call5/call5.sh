#!/bin/bash
# session t, call 5: GPU tests (fused K/V write in the decode kernel, greedy argmax, GEMV codes as words); A/B of the step; throughput
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st argmax; timeout 40 python3 .lab/t/argmax2.py > $OUT/argmax2.json 2>$OUT/argmax2.err; cat $OUT/argmax2.json | tee -a $L
st attn; timeout 90 python3 -m pytest -p no:cacheprovider -q -x tests/unit/test_attention.py tests/unit/test_gumbel.py > $OUT/tests-attn.txt 2>&1; tail -2 $OUT/tests-attn.txt | tee -a $L
st ab; timeout 150 python3 .lab/t/ab.py $OUT/ab.json 128 1 > $OUT/ab.txt 2>&1; grep "round" $OUT/ab.txt | tee -a $L; tail -1 $OUT/ab.txt
for a in "bf16" "fp8 --quantization fp8 --kv-cache-dtype fp8"; do
  set -- $a; n=$1; shift
  st tp-$n; timeout 75 python3 benchmarks/throughput.py --shape llama-3.1-8b "$@" --output $OUT/tp-$n.json > /tmp/tp-$n.txt 2>&1
  python3 -c "import json; print('$n', json.load(open('$OUT/tp-$n.json'))['baton']['output_tok_s'])" | tee -a $L
done
st gpu; timeout 235 python3 -m pytest -p no:cacheprovider -q tests/gpu > $OUT/tests-gpu.txt 2>&1; tail -4 $OUT/tests-gpu.txt | tee -a $L
st done
