#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q tests/gpu/test_fp8_kernels.py -k "block or groups" -p no:cacheprovider > $OUT/tests.txt 2>&1
tail -15 $OUT/tests.txt
grep -E "^E  " $OUT/tests.txt | sort | uniq -c | sort -rn | head -20
timeout 60 python3 .lab/l/probe3.py > $OUT/probe3.txt 2>&1; cat $OUT/probe3.txt
