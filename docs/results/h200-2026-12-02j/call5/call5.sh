python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
st attab; timeout 240 python3 .lab/j/attab.py $OUT/attab.json 2>&1 | tee $OUT/attab.txt | tail -12
st done
