python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
CFG=services/worker/engine/models/layers/configs/NVIDIA_H200.json
st tests; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_kernels.py > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt | tee -a $L
st tune; mkdir -p /tmp/cfg; timeout 200 python3 benchmarks/gemv.py --tune /tmp/cfg --kinds fp8_gemv fp8_gemv_fast fp8_gemv_codes fp8_gemv_codes_fast > $OUT/tune.txt 2>&1; tail -17 $OUT/tune.txt | tee -a $L
cp /tmp/cfg/NVIDIA_H200.json $OUT/NVIDIA_H200-tuned.json
python3 - <<PY
import json
kept = json.load(open("$CFG")); tuned = json.load(open("/tmp/cfg/NVIDIA_H200.json"))
for k in ("fp8_gemv_fast", "fp8_gemv_codes_fast", "measured"):
    kept[k] = tuned[k]
open("$CFG", "w").write(json.dumps(kept, indent=1) + "\n")
PY
cp $CFG $OUT/NVIDIA_H200-kept.json
st latency; timeout 300 python3 benchmarks/latency.py --shape llama-3.1-8b --variants fp8 fp8_fp32_accumulation graphs fp8 fp8_fp32_accumulation --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -3 $OUT/latency.txt | tee -a $L
python3 - <<PY | tee -a $L
import json
d = json.load(open("$OUT/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v.get("fraction_of_own_read_roofline"), v["prefill_ms"], v.get("graph_replay_ms"))
PY
st done
