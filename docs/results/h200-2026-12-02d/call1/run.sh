#!/bin/bash
# device call 1: FP8-cache decode attention (V widened in the load's layout)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
mkdir -p /tmp/nixl && tar -xzf .carry/nixl.tgz -C /tmp/nixl
export PYTHONPATH=/tmp/site:/tmp/nixl:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv > $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt; git diff --stat >> $OUT/commit.txt
t0=$(date +%s)
python3 -m pytest -p no:cacheprovider -q tests/unit/test_attention.py -k "fp8 or dense or longest" > $OUT/test_attention.txt 2>&1; tail -3 $OUT/test_attention.txt
echo "tests $(( $(date +%s) - t0 )) s"
python3 benchmarks/attention_sweep.py --batch 256 --heads 32 --kv-heads 8 --layers 32 --kv-cache-dtypes auto fp8 --output $OUT/sweep-256.json > $OUT/sweep-256.log 2>&1; tail -2 $OUT/sweep-256.log
echo "sweep $(( $(date +%s) - t0 )) s"
python3 benchmarks/attention_sweep.py --batch 1 --min-ctx 32768 --max-ctx 32768 --heads 32 --kv-heads 8 --layers 32 --splits 16 32 --kv-cache-dtypes auto fp8 --output $OUT/sweep-1x32k.json > $OUT/sweep-1x32k.log 2>&1; tail -2 $OUT/sweep-1x32k.log
echo "sweep32k $(( $(date +%s) - t0 )) s"
python3 benchmarks/throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --output $OUT/throughput-fp8.json > $OUT/throughput-fp8.log 2>&1; tail -3 $OUT/throughput-fp8.log
echo "tp fp8 $(( $(date +%s) - t0 )) s"
python3 benchmarks/throughput.py --shape llama-3.1-8b --output $OUT/throughput-bf16.json > $OUT/throughput-bf16.log 2>&1; tail -3 $OUT/throughput-bf16.log
echo "tp bf16 $(( $(date +%s) - t0 )) s"
python3 benchmarks/step_profile.py --shape llama-3.1-8b --batch 256 --quantization fp8 --kv-cache-dtype fp8 --output $OUT/step-fp8.json > $OUT/step-fp8.log 2>&1; tail -30 $OUT/step-fp8.log
echo "step $(( $(date +%s) - t0 )) s"
