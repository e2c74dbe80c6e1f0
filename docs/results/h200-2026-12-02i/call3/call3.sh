#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
CFG=services/worker/engine/models/layers/configs/NVIDIA_H200.json
cp $CFG /tmp/cfg_new.json
git show HEAD:$CFG > /tmp/cfg_old.json
st tests
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_kernels.py -k "gemm" > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt | tee -a $L
TP="python3 benchmarks/throughput.py --shape llama-3.1-8b --inproc --quantization fp8 --kv-cache-dtype fp8"
run() { st "$1"; cp /tmp/cfg_$2.json $CFG; shift 2; timeout 100 "$@" > /tmp/run.txt 2>&1; grep -o '"output_tok_s": [0-9.]*\|"model_seconds": [0-9.]*\|"seconds": [0-9.]*' /tmp/run.txt | head -3 | tr '\n' ' ' | tee -a $L; echo | tee -a $L; }
run "old a" old $TP --step-trace --output $OUT/tp-old-a.json
run "new a" new $TP --step-trace --output $OUT/tp-new-a.json
run "old b" old $TP --step-trace --output $OUT/tp-old-b.json
run "new b" new $TP --step-trace --output $OUT/tp-new-b.json
run "old 32" old $TP --max-num-seqs 32 --num-prompts 96 --step-trace --output $OUT/tp-old-32.json
run "new 32" new $TP --max-num-seqs 32 --num-prompts 96 --step-trace --output $OUT/tp-new-32.json
cp /tmp/cfg_new.json $CFG
st done
