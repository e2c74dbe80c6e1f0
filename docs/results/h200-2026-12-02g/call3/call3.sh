#!/bin/bash
# session t, call 3: which part of the FP8 GEMV change slowed it
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 .lab/t/gemvab.py $OUT/gemvab.json > $OUT/gemvab.txt 2>&1; grep -v Warn $OUT/gemvab.txt | tail -8
