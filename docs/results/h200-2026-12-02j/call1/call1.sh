set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
which ncu; ncu --version | tail -1
NCU="ncu --clock-control none --set full --import-source no"
mkdir -p $OUT/p
prof() { # name regex args...
  local name=$1 rx=$2; shift 2
  timeout 240 $NCU -k regex:"$rx" --launch-skip 2 --launch-count 1 -o $OUT/p/$name python3 .lab/j/probe.py "$@" > $OUT/p/$name.log 2>&1
  ncu -i $OUT/p/$name.ncu-rep --page details > $OUT/p/$name.details.txt 2>&1
  ncu -i $OUT/p/$name.ncu-rep --page source --csv --print-source sass > $OUT/p/$name.sass.csv 2>&1
  tail -3 $OUT/p/$name.log; wc -l $OUT/p/$name.details.txt $OUT/p/$name.sass.csv
}
prof dec_fp8 "^_decode" decode --kv fp8
prof dec_bf16 "^_decode" decode --kv auto
prof dec_fp8_32 "^_decode" decode --kv fp8 --launch 32/2/2
prof gemv_fp8 "_fp8_gemv_kernel" fp8_gemv --launch 28672x4096
prof gemv_bf16 "_gemv_kernel" bf16_gemv --launch 28672x4096
cd $OUT && tar czf reps.tgz p/*.ncu-rep && rm -f p/*.ncu-rep && tar czf text.tgz p && rm -rf p && ls -la
