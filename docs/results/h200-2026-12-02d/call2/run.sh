#!/bin/bash
# device call 2: FP8 fast accumulation (kernel, engine tests, latency, throughput beside bf16)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
mkdir -p /tmp/nixl && tar -xzf .carry/nixl.tgz -C /tmp/nixl
export PYTHONPATH=/tmp/site:/tmp/nixl:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv >> $L
st mm; python3 benchmarks/fp8_mm.py --tokens 64 256 2048 --output $OUT/fp8_mm.json >> $L 2>&1
st tests; python3 -m pytest -p no:cacheprovider -q tests/gpu/test_fp8_kernels.py -k "fast or engine" >> $L 2>&1; tail -2 $L
st tp-bf16; python3 benchmarks/throughput.py --shape llama-3.1-8b --output $OUT/tp-bf16.json >> $L 2>&1
st tp-fp8; python3 benchmarks/throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --output $OUT/tp-fp8.json >> $L 2>&1
st tp-fp8-fast; python3 benchmarks/throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --fp8-fast-accumulation --output $OUT/tp-fp8-fast.json >> $L 2>&1
st latency; python3 benchmarks/latency.py --shape llama-3.1-8b --variants graphs fp8 fp8_fast --output $OUT/latency.json >> $L 2>&1
st done
grep -E "output_tok_s|passed|failed|one_layer|_us\"" $L | cut -c1-300 | tail -20
