#!/bin/bash
# device call 7: piecewise graphs without staging copies (unowned views): test, latency, throughput
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
git log --oneline -1 >> $L; git status --short >> $L
st tests; timeout 120 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gpu_engine.py -k "piecewise" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
st latency; timeout 200 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs piecewise fp8 fp8_piecewise --profile-prefill --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -2 $OUT/latency.txt
python3 -c "
import json
d = json.load(open('$OUT/latency.json'))
for v in d['variants']:
    print(v['variant'], v['decode_ms_per_step'], v['prefill_ms'], v.get('prefill_gpu_span_ms'), round(sum(r['us_per_step'] for r in v.get('prefill_kernels', [])) / 1e3, 2))
"
for a in "bf16" "fp8 --quantization fp8 --kv-cache-dtype fp8" "fp8pw --quantization fp8 --kv-cache-dtype fp8 --piecewise-cuda-graph-tokens 8192" "bf16pw --piecewise-cuda-graph-tokens 8192"; do
  set -- $a; n=$1; shift
  st tp-$n; timeout 100 python3 benchmarks/throughput.py --shape llama-3.1-8b "$@" --output $OUT/tp-$n.json > $OUT/tp-$n.txt 2>&1
  grep -iE "piecewise|captur" $OUT/tp-$n.txt | head -3
  python3 -c "import json; print('$n', json.load(open('$OUT/tp-$n.json'))['baton']['output_tok_s'])"
done
st done
