export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
st long; timeout 540 python3 benchmarks/long_context.py --variants flash_attn_p128 triton flash_attn --lengths 2048 16384 32768 --decode-batches --output $OUT/long_context.json > $OUT/long_context.log 2>&1; grep -E '"prompt"' $OUT/long_context.log | tee -a $L
st done
