#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
CFG=services/worker/engine/models/layers/configs/NVIDIA_H200.json
cp $CFG /tmp/cfg_before.json
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $L
st tests
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_kernels.py -k "gemm or fp8_linear or fast" > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt | tee -a $L
st tune
timeout 250 python3 benchmarks/fp8_mm.py --tune services/worker/engine/models/layers/configs --tokens 16 32 64 128 256 --output $OUT/fp8_gemm_tune.json 2>&1 | grep -v "^  " | tee -a $L
cp $CFG $OUT/NVIDIA_H200.json
cp $CFG /tmp/cfg_after.json
for v in new old; do
  cp /tmp/cfg_$( [ $v = new ] && echo after || echo before ).json $CFG
  st "tp $v"
  timeout 110 python3 benchmarks/throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --inproc --output $OUT/tp-$v.json > /tmp/tp-$v.txt 2>&1
  tail -c 600 /tmp/tp-$v.txt | tee -a $L; echo | tee -a $L
done
cp /tmp/cfg_after.json $CFG
st done
