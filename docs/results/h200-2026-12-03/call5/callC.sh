cp .fa4s/q2 /tmp/fa4/ && (cd /tmp/fa4 && cat q1 q2 > a.tar.xz && echo "$(cat $OLDPWD/.fa4s/SHA256)  a.tar.xz" | sha256sum -c - && mkdir -p /tmp/fa4site && tar -xJf a.tar.xz -C /tmp/fa4site) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv >> $L
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 > $OUT/smi.csv &
SMI=$!
st long; timeout 500 python3 benchmarks/long_context.py --variants flash_attn_p128 flash_attn --lengths 16384 32768 --decode-batches --profile --output $OUT/long_context.json > $OUT/long_context.log 2>&1; echo rc=$? | tee -a $L
grep -E '"prompt"' $OUT/long_context.log | tee -a $L
kill $SMI
python3 - <<'PY' | tee -a $L
import json, os
d = json.load(open(os.environ["OUT"] + "/long_context.json"))
for v in d["variants"]:
    for r in v["prefill"]:
        print(v["variant"], r["prompt"], r["ms"], r["TFLOPs"], r.get("gpu_span_ms"), r.get("kernel_ms"))
        for k in r.get("kernels", [])[:10]:
            print("   ", round(k["us_per_step"] / 1e3, 2), k["calls_per_step"], k["kernel"][:70])
PY
st done
