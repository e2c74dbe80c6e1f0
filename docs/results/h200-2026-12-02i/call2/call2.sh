#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
CFG=services/worker/engine/models/layers/configs/NVIDIA_H200.json
cp $CFG /tmp/cfg_new.json
git show HEAD:$CFG > /tmp/cfg_old.json
st tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_fp8_kernels.py -k "gemm or fp8_linear or fast or engine or cuda_graphs" > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt | tee -a $L
TP="python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc"
run() { st "$1"; shift; timeout 100 "$@" > /tmp/run.txt 2>&1; grep -o '"output_tok_s": [0-9.]*\|"model_seconds": [0-9.]*\|"seconds": [0-9.]*' /tmp/run.txt | head -3 | tr '\n' ' ' | tee -a $L; echo | tee -a $L; }
run bf16 $TP --output $OUT/tp-bf16.json
run "fp8 new" $TP --quantization fp8 --kv-cache-dtype fp8 --step-trace --output $OUT/tp-fp8-new.json
cp /tmp/cfg_old.json $CFG
run "fp8 old" $TP --quantization fp8 --kv-cache-dtype fp8 --step-trace --output $OUT/tp-fp8-old.json
run "fp8 old 32" $TP --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 32 --num-prompts 96 --output $OUT/tp-fp8-old-32.json
cp /tmp/cfg_new.json $CFG
run "fp8 new 32" $TP --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 32 --num-prompts 96 --output $OUT/tp-fp8-new-32.json
st done
