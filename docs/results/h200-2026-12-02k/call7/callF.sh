cp .fa4s/q2 /tmp/fa4/ && (cd /tmp/fa4 && cat q1 q2 > a.tar.xz && echo "$(cat $OLDPWD/.fa4s/SHA256)  a.tar.xz" | sha256sum -c - && mkdir -p /tmp/fa4site && tar -xJf a.tar.xz -C /tmp/fa4site) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
L=$OUT/log.txt
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a $L; }
st latency; timeout 300 python3 benchmarks/latency.py --shape llama-3.1-8b --variants flash_attn triton flash_attn triton --output-len 32 --profile-prefill --output $OUT/latency.json > $OUT/latency.txt 2>&1; tail -2 $OUT/latency.txt | tee -a $L
python3 - <<PY | tee -a $L
import json
d = json.load(open("$OUT/latency.json"))
for v in d["variants"]:
    print(v["variant"], "prefill", v["prefill_ms"], "gpu span", v.get("prefill_gpu_span_ms"))
    for r in (v.get("prefill_kernels") or [])[:6]:
        print("   ", r)
    for r in (v.get("prefill_host") or [])[:8]:
        print("   host", r)
PY
st done
