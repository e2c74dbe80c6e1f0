python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
git log --oneline -1 >> $L 2>/dev/null
st gputests; timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/tests.txt 2>&1; tail -8 $OUT/tests.txt | tee -a $L
st done
