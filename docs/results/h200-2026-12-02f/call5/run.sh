#!/bin/bash
# session s, call 5: GPU tests on the decode graphs per context bound and size (engine first);
# the bf16 codes case that failed in call 4, over 8 seeds; then the other GPU tests
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st engine; timeout 170 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gpu_engine.py > $OUT/tests-1.txt 2>&1; tail -3 $OUT/tests-1.txt
st codes; timeout 30 python3 .lab/s/codes.py 2>&1 | grep -v Warn | tee $OUT/codes.txt | tail -16
st rest; timeout 90 python3 -m pytest -p no:cacheprovider -q tests/gpu --ignore=tests/gpu/test_gpu_engine.py > $OUT/tests-2.txt 2>&1; tail -3 $OUT/tests-2.txt
st done
