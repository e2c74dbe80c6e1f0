python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
python3 -c "import flash_attn.cute; print('flash_attn.cute ok')" 2>&1 | tail -1 | tee -a $L
st gputests; timeout 540 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/tests.txt 2>&1; tail -8 $OUT/tests.txt | tee -a $L
st done
