python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
CFG=services/worker/engine/models/layers/configs/NVIDIA_H200.json
st tests; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_kernels.py -k "fast or gemv or codes" > $OUT/tests.txt 2>&1; tail -15 $OUT/tests.txt | tee -a $L
st tune; mkdir -p /tmp/cfg; timeout 150 python3 benchmarks/gemv.py --tune /tmp/cfg --kinds fp8_gemv_codes fp8_gemv_codes_fast > $OUT/tune.txt 2>&1; tail -12 $OUT/tune.txt | tee -a $L
cp /tmp/cfg/NVIDIA_H200.json $OUT/NVIDIA_H200-tuned.json
python3 - <<PY
import json
kept = json.load(open("$CFG")); tuned = json.load(open("/tmp/cfg/NVIDIA_H200.json"))
kept["fp8_gemv_codes_fast"] = tuned["fp8_gemv_codes_fast"]; kept["measured"] = tuned["measured"]
open("$CFG", "w").write(json.dumps(kept, indent=1) + "\n")
PY
st ncu; timeout 60 ncu --clock-control none --section SpeedOfLight --section Occupancy -k regex:_fp8_gemv_kernel --launch-skip 2 --launch-count 1 python3 .lab/j/probe.py fp8_gemv --launch 28672x4096 --fast > $OUT/ncu_fast.txt 2>&1; grep -E "Duration|DRAM Through|Registers|Achieved Occ" $OUT/ncu_fast.txt | tee -a $L
st latency; timeout 240 python3 benchmarks/latency.py --shape llama-3.1-8b --variants fp8 fp8_fp32_accumulation graphs --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -5 $OUT/latency.txt | tee -a $L
python3 - <<PY | tee -a $L
import json
d = json.load(open("$OUT/latency.json"))
for v in d["variants"]:
    print(v["variant"], v["decode_ms_per_step"], v.get("fraction_of_own_read_roofline"), v["prefill_ms"])
PY
st done
