cp .fa4s/q2 /tmp/fa4/ && (cd /tmp/fa4 && cat q1 q2 > a.tar.xz && echo "$(cat $OLDPWD/.fa4s/SHA256)  a.tar.xz" | sha256sum -c - && mkdir -p /tmp/fa4site && tar -xJf a.tar.xz -C /tmp/fa4site) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl 2>/dev/null
bash .lab/k/call6.sh
