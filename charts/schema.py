"""Writes charts/baton/values.schema.json from values.yaml (``python charts/schema.py``; a test
checks the file is what this writes). Every key of values.yaml is in the schema with the type
of its default; objects take no other key (an unknown key fails ``helm lint``, naming it),
except the free-form maps below; some values get an enum or bounds."""

import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent / "baton"
FREE = {"resources", "requests", "limits", "affinity", "extraResources", "routingPolicy",
        "strategy"}  # fmt: skip
# maps of strings operators extend (a non-string value fails here, not at the API server)
STRING_MAPS = {"nodeSelector", "annotations", "podAnnotations", "podLabels", "labels"}
# Kubernetes quantities ("" where the value may be unset): a typo such as 2GB fails here
QUANTITY = r"^([0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?)?$"
QUANTITIES = {"shmSizeLimit", "modelFilesSizeLimit", "cacheSizeLimit"}
ENUMS = {
    "model.source": ["pvc", "hostPath", "image", "url", "tiny"],
    "autoscaling.kind": ["hpa", "keda"],
    "service.type": ["ClusterIP", "NodePort", "LoadBalancer"],
    "pullPolicy": ["Always", "IfNotPresent", "Never"],
    "antiAffinity": ["soft", "hard", "none"],
    "unhealthyPodEvictionPolicy": ["AlwaysAllow", "IfHealthyBudget"],
}
POOLS = ("prefill.", "decode.", "colocated.")
NUMBERS = {"heartbeatTimeoutSeconds", "intervalSeconds", "prefillBacklogTargetSeconds",
           "decodeKvUsageTarget", "decodeRunningTarget", "tolerance", "minPrefillDecodeRatio",
           "maxPrefillDecodeRatio", "unregisteredAfterSeconds",
           "requestTimeoutSeconds"}  # fmt: skip
INT_ENUMS = {"model.kvBlockSize": [16, 32, 64, 128]}
PORTS = {"port", "metricsPort", "rayPort"}
COUNTS = {"replicas", "minReplicas", "maxReplicas", "pods", "gpus", "gpuBudget",
          "drainTimeoutSeconds", "preStopSeconds", "terminationGracePeriodSeconds",
          "periodSeconds", "failureThreshold", "stabilizationWindowSeconds",
          "maxUnavailable", "unregisteredExitSeconds"}  # fmt: skip


def node(path: str, key: str, value: Any) -> dict[str, Any]:
    where = f"{path}.{key}" if path else key
    if key in FREE and isinstance(value, dict):
        return {"type": "object", "description": f"{where}: a free-form map"}
    if key in STRING_MAPS and isinstance(value, dict):
        return {"type": "object", "additionalProperties": {"type": "string"}}
    if key in QUANTITIES:
        return {"type": "string", "pattern": QUANTITY}
    if where.endswith("leaderWorkerSet.size"):
        return {"type": "integer", "minimum": 2}
    for suffix, values in ENUMS.items():
        if where.endswith(suffix):
            if where.startswith(POOLS) and where.endswith("image.pullPolicy"):
                values = ["", *values]  # "": image.worker's
            return {"type": "string", "enum": values}
    if where in INT_ENUMS:
        return {"type": "integer", "enum": INT_ENUMS[where]}
    if key == "serviceMonitor.enabled" or where.endswith("serviceMonitor.enabled"):
        return {"enum": ["auto", True, False, "true", "false"]}
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int) and key in PORTS:
        return {"type": "integer", "minimum": 1, "maximum": 65535}
    if isinstance(value, int | float) and key in NUMBERS:
        return {"type": "number", "minimum": 0}
    if isinstance(value, int) and key in COUNTS:
        return {"type": "integer", "minimum": 0}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        if key in ("engineArgs", "extraArgs", "keys"):
            return {"type": "array", "items": {"type": "string"}}
        # Kubernetes objects (EnvVar, Volume, Toleration, ...): the API server checks them
        return {"type": "array", "items": {"type": "object"}}
    if isinstance(value, dict):
        return obj(where, value)
    raise TypeError(f"{where}: no schema for {value!r}")


def obj(path: str, values: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {k: node(path, k, v) for k, v in values.items()},
    }


def render() -> str:
    values = yaml.safe_load((HERE / "values.yaml").read_text())
    schema = {"$schema": "https://json-schema.org/draft-07/schema#", "title": "baton values",
              **obj("", values)}  # fmt: skip
    return json.dumps(schema, indent=1) + "\n"


if __name__ == "__main__":
    (HERE / "values.schema.json").write_text(render())
    print(f"wrote {HERE / 'values.schema.json'}")
