#!/bin/bash
# session t, call 6: after reverting the fused K/V write and the GEMV's codes as words: start-up compiles, throughput, greedy argmax
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st compiles; timeout 70 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gpu_engine.py -k "nothing_compiles or greedy" > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt | tee -a $L
st tp-fp8; timeout 60 python3 benchmarks/throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --output $OUT/tp-fp8.json > /tmp/tp.txt 2>&1
python3 -c "import json; print('fp8', json.load(open('$OUT/tp-fp8.json'))['baton']['output_tok_s'])" | tee -a $L
st argmax; timeout 20 python3 .lab/t/argmax2.py > $OUT/argmax2.json 2>/dev/null; cat $OUT/argmax2.json | tr -d '\n ' | tee -a $L; echo
st tp-bf16; timeout 55 python3 benchmarks/throughput.py --shape llama-3.1-8b --output $OUT/tp-bf16.json > /tmp/tp2.txt 2>&1
python3 -c "import json; print('bf16', json.load(open('$OUT/tp-bf16.json'))['baton']['output_tok_s'])" | tee -a $L
st done
