python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
st probe; timeout 420 python3 .lab/k/regprobe.py $OUT/regprobe.json > $OUT/regprobe.txt 2>&1; tail -3 $OUT/regprobe.txt | tee -a $L
st tests; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fused_ops.py -k "store or rotary" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt | tee -a $L
st done
