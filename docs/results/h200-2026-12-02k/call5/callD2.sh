ls /tmp/fa4site /tmp/site >/dev/null || exit 3
mkdir -p /tmp/nixl && tar -xzf .carry/nixl.tgz -C /tmp/nixl || exit 1
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:/tmp/nixl:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st tests; timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flash_attn.py tests/gpu/test_fp8_kernels.py -k "pd or quantize_rows" > $OUT/tests.txt 2>&1; tail -5 $OUT/tests.txt | tee -a $L
st done
