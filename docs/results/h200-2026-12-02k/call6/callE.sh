python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
st latency; timeout 400 python3 benchmarks/latency.py --shape llama-3.1-8b --variants kv_write graphs fp8_kv_write fp8 kv_write graphs --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -3 $OUT/latency.txt | tee -a $L
python3 - <<PY | tee -a $L
import json
d = json.load(open("$OUT/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v.get("fraction_of_own_read_roofline"), v.get("fraction_of_read_roofline"), v["prefill_ms"])
PY
st done
