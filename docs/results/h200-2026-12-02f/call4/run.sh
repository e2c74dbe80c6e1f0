#!/bin/bash
# session s, call 4: the decode graphs per context bound (long_context 16384, tokens_per_split 32)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st tests; timeout 270 python3 -m pytest -p no:cacheprovider -q -x tests/gpu > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
st latency128; timeout 60 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 --output $OUT/latency-128.json > /tmp/l1.txt 2>&1; tail -1 /tmp/l1.txt
st latency2048; timeout 60 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 --input-len 2048 --output $OUT/latency-2048.json > /tmp/l2.txt 2>&1; tail -1 /tmp/l2.txt
python3 -c "
import json
for f in ('128', '2048'):
    d = json.load(open('$OUT/latency-' + f + '.json'))
    for v in d['variants']:
        print(f, v['variant'], v['decode_ms_per_step'], v['graph_replay_ms'], v['fraction_of_own_read_roofline'], v['prefill_ms'])
" | tee -a $L
st long; timeout 120 python3 benchmarks/long_context.py --variants triton --lengths 2048 --decode-batches 1 16 --output $OUT/long-decode.json > /tmp/lc.txt 2>&1; tail -2 /tmp/lc.txt
python3 -c "
import json
d = json.load(open('$OUT/long-decode.json'))
for r in d['variants'][0]['decode']: print(r)
" | tee -a $L
for a in "bf16" "fp8 --quantization fp8 --kv-cache-dtype fp8"; do
  set -- $a; n=$1; shift
  st tp-$n; timeout 80 python3 benchmarks/throughput.py --shape llama-3.1-8b "$@" --output $OUT/tp-$n.json > /tmp/tp-$n.txt 2>&1
  python3 -c "import json; print('$n', json.load(open('$OUT/tp-$n.json'))['baton']['output_tok_s'])" | tee -a $L
done
st done
