#!/bin/bash
# session t, call 2: FP8 GEMV over codes as words (no shared-memory trip), greedy argmax in slices
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st gemv; timeout 120 python3 .lab/t/gemvab.py $OUT/gemvab.json > $OUT/gemvab.txt 2>&1; grep -v Warn $OUT/gemvab.txt | tail -8 | tee -a $L
st tests; timeout 200 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_fp8_kernels.py tests/unit/test_gumbel.py tests/unit/test_sampler.py tests/unit/test_fp8_kernels.py > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt | tee -a $L
st ab; timeout 200 python3 .lab/t/ab.py $OUT/ab.json > $OUT/ab.txt 2>&1; grep "round" $OUT/ab.txt | tee -a $L; tail -3 $OUT/ab.txt
st done
