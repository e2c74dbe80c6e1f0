#!/bin/bash
# device call 9: piecewise graphs on by default: GPU tests, latency, throughput, where the 2k prefill's wall goes
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
git log --oneline -1 >> $L; git status --short >> $L
st tests; timeout 230 python3 -m pytest -p no:cacheprovider -q -x tests/gpu > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
st latency; timeout 120 python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs no_piecewise fp8 fp8_no_piecewise --profile-prefill --output $OUT/latency.json > /tmp/latency.txt 2>&1; tail -1 /tmp/latency.txt
python3 -c "
import json
d = json.load(open('$OUT/latency.json'))
for v in d['variants']:
    print(v['variant'], v['decode_ms_per_step'], v['prefill_ms'], v.get('prefill_gpu_span_ms'), round(sum(r['us_per_step'] for r in v.get('prefill_kernels', [])) / 1e3, 2))
"
st gaps; timeout 90 python3 .lab/gaps.py graphs fp8 > $OUT/gaps.txt 2>&1; grep -v Warn $OUT/gaps.txt | tail -64
for a in "bf16" "fp8 --quantization fp8 --kv-cache-dtype fp8"; do
  set -- $a; n=$1; shift
  st tp-$n; timeout 70 python3 benchmarks/throughput.py --shape llama-3.1-8b "$@" --output $OUT/tp-$n.json > /tmp/tp-$n.txt 2>&1
  grep -iE "piecewise" /tmp/tp-$n.txt | head -2
  python3 -c "import json; print('$n', json.load(open('$OUT/tp-$n.json'))['baton']['output_tok_s'])"
done
st done
