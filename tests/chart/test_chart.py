"""The Helm chart, as far as a machine without a cluster allows: ``helm lint`` and
``helm template | kubernetes-validate --strict`` (Kubernetes 1.30 and 1.33 schemas; the pod
templates of a LeaderWorkerSet as PodTemplates, its spec against the CRD's schema) for every
value set in charts/baton/ci, the rendered manifests equal to the committed golden files, the
negative value sets refused with a message naming the value, and assertions over the objects.
The defects an install on a real API server found each have a test here
(tests/chart/test_operator.py holds the ones about operating the release).

Golden files: ``BATON_UPDATE_GOLDEN=1 pytest tests/chart`` rewrites them (then read the diff).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import CHART, ROOT, SETS, TOKEN, helm, objects, rendered

GOLDEN = Path(__file__).parent / "golden"
NEGATIVE = Path(__file__).parent / "negative"
CRDS = {"ServiceMonitor", "PodMonitor", "ScaledObject", "LeaderWorkerSet"}  # not in Kubernetes'
KUBERNETES = ["1.30.0", "1.33.0"]  # the oldest the chart supports, and a current one


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def template(o: dict[str, Any]) -> dict[str, Any]:
    """The pod template that serves: a Deployment's or StatefulSet's, a LeaderWorkerSet
    leader's."""
    if o["kind"] == "LeaderWorkerSet":
        return o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]  # type: ignore[no-any-return]
    return o["spec"]["template"]  # type: ignore[no-any-return]


def workers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def is_worker(o: dict[str, Any]) -> bool:
        if o["kind"] not in ("Deployment", "LeaderWorkerSet"):
            return False
        return template(o)["metadata"]["labels"].get("baton.dev/worker") == "true"

    return [o for o in objs if is_worker(o)]


def pod_spec(o: dict[str, Any]) -> dict[str, Any]:
    return template(o)["spec"]  # type: ignore[no-any-return]


def arg(container: dict[str, Any], flag: str) -> str | None:
    for a in container.get("args", []):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]  # type: ignore[no-any-return]
    return None


# -- lint, validation, golden files ------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_helm_lint(name: str) -> None:
    values = CHART / "ci" / f"{name}-values.yaml"  # (lint takes no --api-versions)
    cmd = [helm(), "lint", str(CHART), "--strict", "-f", str(values),
           "--set", f"internalToken.value={TOKEN}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def pod_templates(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's two pod templates as PodTemplate objects, which Kubernetes' own
    schemas check strictly."""
    out = []
    for o in objs:
        if o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                name = f"{o['metadata']['name']}-{part.lower()}"
                out.append({"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": name}, "template": lwt[part]})  # fmt: skip
    return out


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("name", SETS)
def test_manifests_validate_against_kubernetes(name: str, version: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.yaml"
    objs = objects(name)
    path.write_text(rendered(name) + "".join("---\n" + yaml.safe_dump(t)
                                             for t in pod_templates(objs)))  # fmt: skip
    validate = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(validate), "--strict", "-k", version, str(path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    for line in text.splitlines():  # the only objects without a schema are the CRDs' kinds
        assert not line.startswith(("ERROR", "FAIL")), line
        if line.startswith("WARN"):
            assert any(f"kind {k} " in line for k in CRDS), line
    passed = text.count(" passed for resource ")
    expected = [o for o in objs if o["kind"] not in CRDS] + pod_templates(objs)
    assert passed == len(expected) > 0, {o["kind"] for o in objs}


def strict(schema: Any) -> Any:
    """A CRD's structural schema made strict: an object with properties takes no other key
    (the API server would drop one silently)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    return [strict(v) for v in schema] if isinstance(schema, list) else schema


def test_leader_worker_sets_follow_the_crd_schema() -> None:
    """The LeaderWorkerSet spec against the v1 CRD's schema (tests/chart/schemas: the lws
    project's config/crd/bases, pod templates left to the test above)."""
    import jsonschema

    schema = strict(json.loads((Path(__file__).parent / "schemas" /
                                "leaderworkerset-v1-spec.json").read_text()))  # fmt: skip
    found = [o for name in SETS for o in objects(name) if o["kind"] == "LeaderWorkerSet"]
    assert found
    for o in found:
        assert o["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        jsonschema.validate(o["spec"], schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema does refuse a wrong spec
        jsonschema.validate({**found[0]["spec"], "restartPolicy": "Always"}, schema)


@pytest.mark.parametrize("name", SETS)
def test_golden(name: str) -> None:
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("BATON_UPDATE_GOLDEN"):
        golden.write_text(rendered(name))
    assert golden.exists(), f"no golden file {golden}: run with BATON_UPDATE_GOLDEN=1"
    assert rendered(name) == golden.read_text(), f"{name}: the chart renders differently"


@pytest.mark.parametrize("path", sorted(NEGATIVE.glob("*.yaml")), ids=lambda p: p.stem)
def test_negative_value_sets_fail_with_a_clear_message(path: Path) -> None:
    expect = path.read_text().splitlines()[0].removeprefix("# expect: ")
    out = subprocess.run([helm(), "template", "rel", str(CHART), "-f", str(path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0, f"{path.name} rendered"
    assert expect in out.stderr, out.stderr


def test_generated_files_are_current() -> None:
    sys.path.insert(0, str(ROOT / "charts"))
    try:
        import dashboard
        import schema
    finally:
        sys.path.pop(0)
    assert (CHART / "values.schema.json").read_text() == schema.render(), "python charts/schema.py"
    assert (CHART / "files" / "dashboard.json").read_text() == dashboard.render(), (
        "python charts/dashboard.py"
    )


# -- what the objects must say ------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_workers_start_ready_only_when_serving_and_drain_in_their_grace(name: str) -> None:
    for w in workers(objects(name)):
        spec = pod_spec(w)
        (c,) = spec["containers"]
        # started once the model is loaded, whatever the schedulers do (defect 4)
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"  # the loop, not the engine
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = float(arg(c, "--drain-timeout") or 0)
        assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
        assert arg(c, "--worker-id") == "$(POD_NAME)"  # what pod discovery matches on
        assert arg(c, "--host") == "$(POD_IP)" and arg(c, "--advertise-host") == "$(POD_IP)"
        assert any(v["name"] == "shm" and v["emptyDir"]["medium"] == "Memory"
                   for v in spec["volumes"])  # fmt: skip


@pytest.mark.parametrize("name", SETS)
def test_no_replicas_when_autoscaling(name: str) -> None:
    objs = objects(name)
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in objs
              if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")}  # fmt: skip
    for w in workers(objs):
        assert ("replicas" in w["spec"]) == (w["metadata"]["name"] not in scaled), w["metadata"]
    if name in ("hpa-2p4d", "keda"):
        assert scaled == {"rel-baton-prefill", "rel-baton-decode"}


def test_hpa_behaviour_defaults_and_signals() -> None:
    objs = objects("hpa-2p4d")
    decode = one(objs, "HorizontalPodAutoscaler", "rel-baton-decode")
    prefill = one(objs, "HorizontalPodAutoscaler", "rel-baton-prefill")
    up, down = decode["spec"]["behavior"]["scaleUp"], decode["spec"]["behavior"]["scaleDown"]
    assert up["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 180}]
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    assert down["stabilizationWindowSeconds"] == 300
    assert (decode["spec"]["minReplicas"], prefill["spec"]["minReplicas"]) == (4, 2)
    names = {m["external"]["metric"]["name"] for m in decode["spec"]["metrics"]}
    assert names == {"baton_pool_kv_usage", "baton_pool_running_requests"}
    (m,) = prefill["spec"]["metrics"]
    assert m["external"]["metric"]["name"] == "baton_pool_prefill_backlog_seconds"
    keda = one(objects("keda"), "ScaledObject", "rel-baton-decode")
    assert keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == \
        decode["spec"]["behavior"]  # fmt: skip
    assert all(t["type"] == "prometheus" for t in keda["spec"]["triggers"])


@pytest.mark.parametrize("name", SETS)
def test_every_container_is_non_root_with_a_read_only_root(name: str) -> None:
    for o in objects(name):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(o)
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"], c["name"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}


def test_ipc_lock_and_rdma_only_where_asked() -> None:
    for w in workers(objects("hpa-2p4d")):
        (c,) = pod_spec(w)["containers"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for w in workers(objects("cpu-demo")):
        (c,) = pod_spec(w)["containers"]
        assert "add" not in c["securityContext"]["capabilities"]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def rules(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return one(objs, "Role", "rel-baton-scheduler")["rules"]  # type: ignore[no-any-return]


def test_rbac_is_exactly_what_the_watch_and_the_planner_need() -> None:
    # discovery only: read pods
    assert rules(objects("default")) == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]  # fmt: skip
    # the planner sets replicas: + patch pods (deletion cost), get/patch the pools' scale
    assert rules(objects("monitoring")) == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"],
         "resourceNames": ["rel-baton-decode", "rel-baton-prefill"], "verbs": ["get", "patch"]},
    ]  # fmt: skip
    for name in SETS:
        objs = objects(name)
        assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
        for o in objs:  # only the scheduler gets a service-account token
            if o["kind"] in ("Deployment", "StatefulSet"):
                mounts = pod_spec(o).get("automountServiceAccountToken", True)
                assert mounts == o["metadata"]["name"].endswith("-scheduler"), o["metadata"]


def test_discovery_selects_exactly_the_worker_pods() -> None:
    from services.global_scheduler.discovery import parse_selector

    for name in SETS:
        objs = objects(name)
        (c,) = pod_spec(one(objs, "StatefulSet", "rel-baton-scheduler"))["containers"]
        terms = parse_selector(arg(c, "--pod-selector") or "")
        for o in objs:
            if o["kind"] not in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
                continue
            labels = template(o)["metadata"]["labels"]
            selected = all(labels.get(k) == v for k, v in terms.items())
            assert selected == (o in workers(objs)), o["metadata"]["name"]
            if o["kind"] == "LeaderWorkerSet":  # a group's Ray workers are no Baton workers
                ray = o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
                assert not all(ray.get(k) == v for k, v in terms.items())
        for w in workers(objs):  # every replica, through the headless Service's name
            (wc,) = pod_spec(w)["containers"]
            assert arg(wc, "--scheduler") == "dns:rel-baton-scheduler-headless.serving.svc:50051"
            one(objs, "Service", "rel-baton-scheduler-headless")


def policy(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return one(objs, "NetworkPolicy", f"rel-baton-{component}")["spec"]  # type: ignore[no-any-return]


def test_network_policy_isolates_redis_and_the_workers() -> None:
    objs = objects("default")
    sched = {"app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "rel",
             "app.kubernetes.io/component": "scheduler"}  # fmt: skip
    gateway = {**sched, "app.kubernetes.io/component": "gateway"}
    peers = {"app.kubernetes.io/instance": "rel", "baton.dev/worker": "true"}
    (redis,) = policy(objs, "redis")["ingress"]
    assert redis["from"] == [{"podSelector": {"matchLabels": sched}}]
    grpc, kv, metrics = policy(objs, "workers")["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert [f["podSelector"]["matchLabels"] for f in grpc["from"]] == [gateway, sched]
    assert kv == {"from": [{"podSelector": {"matchLabels": peers}}]}  # KV pulls: peers only
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert all(p["policyTypes"] == ["Ingress"] for p in
               (policy(objs, c) for c in ("redis", "workers", "scheduler", "gateway")))  # fmt: skip
    # every pod of the release is under a policy, the gateway alone open to the outside
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels = o["spec"]["template"]["metadata"]["labels"]
            covered = [
                p
                for p in objs
                if p["kind"] == "NetworkPolicy"
                and all(
                    labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items()
                )
            ]
            assert covered, o["metadata"]["name"]
            open_to_all = any(
                "from" not in rule
                for p in covered
                for rule in p["spec"]["ingress"]
                if rule.get("ports") != [{"port": "metrics", "protocol": "TCP"}] and "ports" in rule
            )
            assert open_to_all == o["metadata"]["name"].endswith("-gateway"), o["metadata"]["name"]


def test_monitoring_objects_only_with_the_operator_api() -> None:
    kinds = {o["kind"] for o in objects("monitoring")}
    assert {"ServiceMonitor", "PodMonitor"} <= kinds
    for name in SETS:
        if name not in ("monitoring", "production"):
            objs = objects(name)
            assert not {"ServiceMonitor", "PodMonitor"} & {o["kind"] for o in objs}
            for w in workers(objs):
                assert template(w)["metadata"]["annotations"]["prometheus.io/scrape"]
    board_map = one(objects("default"), "ConfigMap", "rel-baton-dashboard")
    board = json.loads(board_map["data"]["baton.json"])
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    assert 'le="0.5"' in exprs and 'le="0.05"' in exprs and "__" not in exprs
    for metric in ("baton_gateway_ttft_seconds", "baton_planner_desired_replicas",
                   "baton_gateway_resumes_total", "baton_worker_kv_pull_bytes_total",
                   "baton_pool_kv_usage", "baton_scheduler_route_decisions_total"):  # fmt: skip
        assert metric in exprs


def test_api_keys_come_from_a_secret_and_redis_can_be_external() -> None:
    objs = objects("monitoring")
    (c,) = pod_spec(one(objs, "Deployment", "rel-baton-gateway"))["containers"]
    assert arg(c, "--api-key-file") == "/etc/baton/api-keys/keys"
    assert not any("sk-demo" in a for a in c["args"])  # never on the command line
    one(objs, "Secret", "rel-baton-api-keys")
    ext = objects("external-redis")
    assert not [o for o in ext if o["metadata"]["name"] == "rel-baton-redis"]
    (s,) = pod_spec(one(ext, "StatefulSet", "rel-baton-scheduler"))["containers"]
    assert arg(s, "--scale-deployment") is None  # two replicas: publish only


@pytest.mark.parametrize("name", SETS)
def test_the_scheduler_accepts_the_configs_the_chart_writes(name: str) -> None:
    """planner.json and routing-policy.json load as the scheduler loads them, and the planner
    gets each pool's bounds and GPUs from the pool's values (a LeaderWorkerSet replica: the
    GPUs of all its pods)."""
    from services.global_scheduler.planner import PlannerConfig
    from services.global_scheduler.routing import RoutingPolicy

    objs = objects(name)
    data = one(objs, "ConfigMap", "rel-baton-scheduler")["data"]
    config = PlannerConfig.from_dict(json.loads(data["planner.json"]))
    RoutingPolicy(json.loads(data["routing-policy.json"]) or None)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values_set = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}
    for w in workers(objs):
        pool = w["metadata"]["name"].removeprefix("rel-baton-")
        key = "colocated" if pool == "both" else pool
        auto = {**values[key]["autoscaling"], **values_set.get(key, {}).get("autoscaling", {})}
        bounds = config.bounds(pool)
        assert (bounds.min_replicas, bounds.max_replicas) == (auto["minReplicas"],
                                                              auto["maxReplicas"])  # fmt: skip
        group = values_set.get(key, {}).get("leaderWorkerSet", {})
        pods = group.get("size", 1) if group.get("enabled") else 1  # every pod of a group
        assert bounds.gpus_per_replica == values_set.get(key, {}).get("gpus", 1) * pods


def test_every_pool_gets_the_one_kv_page_size() -> None:
    """A prefill and a decode worker exchange KV only when their pages match: the page size is
    one chart value, given to every worker pool."""
    cmd = [helm(), "template", "rel", str(CHART), "-f", str(CHART / "ci" / "hpa-2p4d-values.yaml"),
           "--set", "model.kvBlockSize=128", "--set", f"internalToken.value={TOKEN}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pools = workers([d for d in yaml.safe_load_all(out.stdout) if d])
    assert len(pools) >= 2
    for pool in pools:
        [container] = [c for c in pod_spec(pool)["containers"] if c["name"] == "worker"]
        assert arg(container, "--block-size") == "128", pool["metadata"]["name"]
    assert all(arg(c, "--block-size") == "16" for o in workers(objects("default"))
               for c in pod_spec(o)["containers"] if c["name"] == "worker")  # fmt: skip
