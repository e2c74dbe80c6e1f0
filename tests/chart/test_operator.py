"""The chart as an operator meets it: one test per defect that an install on a real API server
found (numbered as in the issue that listed them), and what operators of other serving charts
expect beside them. Each renders the chart with ``helm template`` and reads the objects."""

import json
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.test_chart import arg, one, pod_spec, template, workers
from tests.helpers import CHART, ROOT, SETS, TOKEN, helm, objects

RELEASE_53 = "r" * 53  # the longest release name Helm accepts


def render(
    *sets: str, release: str = "rel", values: str | None = None, operator: bool = False,
    ok: bool = True,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    cmd = [helm(), "template", release, str(CHART), "--namespace", "serving",
           "--set", f"internalToken.value={TOKEN}"]  # fmt: skip
    if values:
        cmd += ["-f", str(CHART / "ci" / f"{values}-values.yaml")]
    if operator:
        cmd += ["--api-versions", "monitoring.coreos.com/v1"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert (out.returncode == 0) == ok, out.stderr
    return out


def objs(*sets: str, **kw: Any) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(*sets, **kw).stdout) if d]


def pod_templates(o: dict[str, Any]) -> list[dict[str, Any]]:
    if o["kind"] == "LeaderWorkerSet":
        lwt = o["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    if o["kind"] in ("Deployment", "StatefulSet"):
        return [o["spec"]["template"]]
    return []


def containers(o: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for t in pod_templates(o)
            for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]]  # fmt: skip


# -- 1. names -------------------------------------------------------------------------------------

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
REVISION_HASH = 11  # "-" and up to 10 characters a StatefulSet's revision label adds


@pytest.mark.parametrize("values", ["production", "multinode", "external-redis"])
def test_1_every_name_and_label_fits_for_the_longest_release_name(values: str) -> None:
    found = objs(release=RELEASE_53, values=values, operator=True)
    assert found
    for o in found:
        name = o["metadata"]["name"]
        assert len(name) <= 63 and DNS_LABEL.match(name), name
        if o["kind"] == "StatefulSet":  # its pods' controller-revision-hash label
            assert len(name) + REVISION_HASH <= 63, name
        if o["kind"] == "LeaderWorkerSet":  # its groups' StatefulSets: name-<group>, hashed
            assert len(name) + len("-999") + REVISION_HASH <= 63, name
        labelled = [o["metadata"]] + [t["metadata"] for t in pod_templates(o)]
        for meta in labelled:
            for key, value in (meta.get("labels") or {}).items():
                assert len(str(value)) <= 63, (name, key, value)
    headless = [o for o in found if o["metadata"]["name"].endswith("-scheduler-headless")]
    assert len(headless) == 1


def test_1_a_long_full_name_override_is_cut_too() -> None:
    for o in objs("fullnameOverride=" + "x" * 63):
        assert len(o["metadata"]["name"]) <= 63


# -- 2. the scheduler restarts when anything it reads at start changes ----------------------------


def checksum(*sets: str) -> str:
    sched = one(objs(*sets), "StatefulSet", "rel-baton-scheduler")
    return sched["spec"]["template"]["metadata"]["annotations"]["checksum/config"]  # type: ignore[no-any-return]


def test_2_the_scheduler_checksum_covers_the_planner_bounds_and_gpus() -> None:
    base = checksum()
    changed = {
        "decode.autoscaling.maxReplicas=9", "prefill.autoscaling.minReplicas=2",
        "decode.gpus=2", "planner.gpuBudget=8", "scheduler.routingPolicy.prefix_weight=2",
    }  # fmt: skip
    for s in changed:
        assert checksum(s) != base, s
    assert checksum("gateway.replicas=5") == base  # nothing the scheduler reads


# -- 3. the HPA signal is the release's, once -----------------------------------------------------


def test_3_hpa_and_keda_select_the_release_and_namespace_series() -> None:
    want = {"namespace": "serving", "app_kubernetes_io_instance": "rel"}
    hpas = [o for o in objects("hpa-2p4d") if o["kind"] == "HorizontalPodAutoscaler"]
    assert len(hpas) == 2
    for hpa in hpas:
        pool = hpa["metadata"]["name"].removeprefix("rel-baton-")
        for m in hpa["spec"]["metrics"]:
            labels = m["external"]["metric"]["selector"]["matchLabels"]
            assert labels == {**want, "pool": pool}
    for so in [o for o in objects("keda") if o["kind"] == "ScaledObject"]:
        for t in so["spec"]["triggers"]:
            query = t["metadata"]["query"]
            assert query.startswith("max(")  # the scheduler replicas export one value each
            assert 'namespace="serving"' in query and 'app_kubernetes_io_instance="rel"' in query


def test_3_the_monitors_give_every_series_the_release_label_the_selectors_use() -> None:
    monitors = [o for o in objects("production") if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert {o["metadata"]["name"] for o in monitors} == {
        "rel-baton-scheduler", "rel-baton-gateway", "rel-baton-workers"}  # fmt: skip
    for o in monitors:
        endpoints = o["spec"].get("endpoints") or o["spec"]["podMetricsEndpoints"]
        for e in endpoints:
            assert {"targetLabel": "app_kubernetes_io_instance", "replacement": "rel",
                    "action": "replace"} in e["relabelings"]  # fmt: skip


def test_3_the_documented_adapter_rules_take_the_max_over_scheduler_replicas() -> None:
    """The HPA reads External metrics through an adapter; summing the scheduler replicas'
    series would double the signal. The prometheus-adapter rules in docs/deploy.md take the
    max, over exactly the labels the HPA selects on."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    found = re.search(r"```yaml\n( *# prometheus-adapter values.*?)\n *```", text, re.S)
    assert found, "docs/deploy.md: no prometheus-adapter values block"
    rules = yaml.safe_load(textwrap.dedent(found.group(1)))["rules"]["external"]
    names = set()
    for rule in rules:
        assert rule["metricsQuery"].startswith("max(<<.Series>>{<<.LabelMatchers>>})"), rule
        names.add(rule["seriesQuery"].split("{")[0])
    assert names == {"baton_pool_prefill_backlog_seconds", "baton_pool_kv_usage",
                     "baton_pool_running_requests"}  # fmt: skip


# -- 4. a scheduler outage restarts no worker and blocks no drain ---------------------------------


@pytest.mark.parametrize("name", SETS)
def test_4_worker_startup_does_not_depend_on_the_scheduler(name: str) -> None:
    found = objects(name)
    for w in workers(found):
        (c,) = pod_spec(w)["containers"]
        assert c["startupProbe"]["httpGet"]["path"] == "/health"  # the model loaded
        assert arg(c, "--unregistered-exit-seconds") == "0"  # an outage reloads no model
    for pdb in [o for o in found if o["kind"] == "PodDisruptionBudget"]:
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", pdb["metadata"]


# -- 5. scheduler replicas are in no worker's arguments -------------------------------------------


def test_5_adding_a_scheduler_replica_leaves_the_worker_pods_unchanged() -> None:
    def worker_templates(*sets: str) -> list[Any]:
        return [template(w) for w in workers(objs(*sets, values="external-redis"))]

    one_replica = worker_templates("scheduler.replicas=1")
    three = worker_templates("scheduler.replicas=3")
    assert one_replica and one_replica == three


# -- 6. the gateway copies the tokenizer and the config, bounded ----------------------------------

MODEL_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "model-00001-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "model.gguf"]  # fmt: skip
# what the gateway copies (a .gguf holds its tokenizer: it stays)
GATEWAY_FILES = {"config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "model.safetensors.index.json",
                 "model.gguf"}  # fmt: skip


def fake_model(root: Path) -> Path:
    src = root / "src" / "model"
    src.mkdir(parents=True)
    for f in MODEL_FILES:
        (src / f).write_text(f)
    return src


@pytest.mark.parametrize("source", ["image", "url"])
def test_6_the_gateway_copies_no_weights_into_a_bounded_volume(source: str, tmp_path: Path) -> None:
    src = fake_model(tmp_path)
    sets = [f"model.source={source}", "model.image.repository=models/qwen",
            "model.url.location=https://example.com/m.tar.gz"]  # fmt: skip
    found = objs(*sets)
    gw = pod_spec(one(found, "Deployment", "rel-baton-gateway"))
    (init,) = gw["initContainers"]
    (volume,) = [v for v in gw["volumes"] if v["name"] == "model"]
    assert volume["emptyDir"]["sizeLimit"] == "2Gi"
    assert init["resources"]["requests"]["ephemeral-storage"] == "2Gi"
    (c,) = gw["containers"]
    assert c["resources"]["requests"]["ephemeral-storage"] == "2Gi"
    # run the init container's own command here, on a fake checkpoint
    dest = tmp_path / "models"
    dest.mkdir()
    script = init["command"][2].replace("/models", str(dest))
    env = {"PATH": "/usr/bin:/bin"}
    if source == "image":
        env["MODEL_DIR"] = str(src)
    else:
        tarball = tmp_path / "m.tar.gz"
        subprocess.run(["tar", "-czf", str(tarball), "-C", str(src), "."], check=True)
        script = script.replace('curl -fsSL "$MODEL_URL"', f"cat {tarball}")
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=30)
    assert {p.name for p in dest.rglob("*") if p.is_file()} == GATEWAY_FILES
    # the workers copy everything
    (winit,) = pod_spec(workers(found)[0])["initContainers"]
    assert "exclude" not in " ".join(winit["command"])


# -- 7. /metrics is not public --------------------------------------------------------------------


def test_7_the_gateway_serves_metrics_on_a_port_no_service_or_ingress_exposes() -> None:
    found = objects("production")
    gw = one(found, "Deployment", "rel-baton-gateway")
    (c,) = pod_spec(gw)["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert arg(c, "--metrics-port") == str(ports["metrics"]) != str(ports["http"])
    svc = one(found, "Service", "rel-baton-gateway")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]
    ingress = one(found, "Ingress", "rel-baton-gateway")
    backends = [p["backend"]["service"]["port"] for r in ingress["spec"]["rules"]
                for p in r["http"]["paths"]]  # fmt: skip
    assert backends == [{"name": "http"}]
    # and only scrapers reach the metrics port
    rules = one(found, "NetworkPolicy", "rel-baton-gateway")["spec"]["ingress"]
    (metrics,) = [r for r in rules if r["ports"][0]["port"] == "metrics"]
    assert metrics["from"]


# -- 8. no Redis password in a pod spec -----------------------------------------------------------


def test_8_an_external_redis_url_reaches_the_scheduler_through_a_secret() -> None:
    secret = "s3cret-pa55word"
    found = objs(f"redis.external.url=redis://:{secret}@redis.shared.svc:6379/3",
                 "scheduler.replicas=2")  # fmt: skip
    for o in found:
        if o["kind"] != "Secret":
            assert secret not in json.dumps(o), o["metadata"]["name"]
    (s,) = pod_spec(one(found, "StatefulSet", "rel-baton-scheduler"))["containers"]
    assert arg(s, "--redis-url-file") == "/etc/baton/redis/url" and arg(s, "--redis-url") is None
    made = one(found, "Secret", "rel-baton-redis-url")
    assert made["data"]["url"]  # base64 of the URL
    (vol,) = [v for v in pod_spec(one(found, "StatefulSet", "rel-baton-scheduler"))["volumes"]
              if v["name"] == "redis-url"]  # fmt: skip
    assert vol["secret"]["secretName"] == "rel-baton-redis-url"
    # the operator's own Secret: the chart makes none
    theirs = objs("redis.external.existingSecret=my-redis", "scheduler.replicas=2")
    assert not [o for o in theirs if o["metadata"]["name"] == "rel-baton-redis-url"]
    (vol,) = [v for v in pod_spec(one(theirs, "StatefulSet", "rel-baton-scheduler"))["volumes"]
              if v["name"] == "redis-url"]  # fmt: skip
    assert vol["secret"]["secretName"] == "my-redis"


# -- 9. a stock Prometheus may scrape -------------------------------------------------------------

# the labels the Prometheus operator gives a kube-prometheus-stack Prometheus pod, and its
# namespace's (Kubernetes labels every namespace with its name)
PROMETHEUS = {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/instance":
              "kube-prometheus-stack-prometheus", "prometheus": "kube-prometheus-stack-prometheus",
              "operator.prometheus.io/name": "kube-prometheus-stack-prometheus"}  # fmt: skip
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if op in ("In", "NotIn") and (value in e["values"]) != (op == "In"):
            return False
        if op in ("Exists", "DoesNotExist") and (value is not None) != (op == "Exists"):
            return False
    return True


def admits(rule: dict[str, Any], pod: dict[str, str], ns: dict[str, str], same_ns: bool) -> bool:
    """Whether a NetworkPolicy ingress rule's ``from`` admits a pod (its labels, its
    namespace's labels, and whether it is in the policy's namespace)."""
    if "from" not in rule:
        return True
    for peer in rule["from"]:
        pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
        if ns_sel is None and not same_ns:  # a podSelector alone: the policy's namespace
            continue
        if ns_sel is not None and not selects(ns_sel, ns):
            continue
        if pod_sel is None or selects(pod_sel, pod):
            return True
    return False


def metrics_rules(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for p in [o for o in found if o["kind"] == "NetworkPolicy"]:
        for rule in p["spec"]["ingress"]:
            if rule.get("ports", [{}])[0].get("port") == "metrics":
                out[p["metadata"]["name"]] = rule
    return out


def test_9_the_default_network_policy_admits_a_stock_prometheus() -> None:
    rules = metrics_rules(objects("default"))
    assert set(rules) == {"rel-baton-gateway", "rel-baton-scheduler", "rel-baton-workers"}
    for name, rule in rules.items():
        assert admits(rule, PROMETHEUS, MONITORING_NS, same_ns=False), name
        assert admits(rule, {"baton.dev/metrics-scraper": "true"}, {}, same_ns=True), name
        assert not admits(rule, {"app": "curl"}, MONITORING_NS, same_ns=False), name
        assert not admits(rule, {"app": "curl"}, {}, same_ns=True), name
    # the gRPC ports stay closed to it
    for p in [o for o in objects("default") if o["kind"] == "NetworkPolicy"]:
        for rule in p["spec"]["ingress"]:
            if rule.get("ports", [{}])[0].get("port") in ("grpc", "redis"):
                assert not admits(rule, PROMETHEUS, MONITORING_NS, same_ns=False)


# -- 10. rollouts and disruptions per component ---------------------------------------------------


def test_10_rollout_strategy_per_pool_and_budgets_and_spread_for_gateway_and_scheduler() -> None:
    found = objs("prefill.strategy.rollingUpdate.maxSurge=0",
                 "prefill.strategy.rollingUpdate.maxUnavailable=1")  # fmt: skip
    pre = one(found, "Deployment", "rel-baton-prefill")
    dec = one(found, "Deployment", "rel-baton-decode")
    assert pre["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert dec["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pdbs = {o["metadata"]["name"] for o in found if o["kind"] == "PodDisruptionBudget"}
    assert pdbs == {f"rel-baton-{c}" for c in ("gateway", "scheduler", "prefill", "decode")}
    for component, kind in (("gateway", "Deployment"), ("scheduler", "StatefulSet")):
        spec = pod_spec(one(found, kind, f"rel-baton-{component}"))
        anti = spec["affinity"]["podAntiAffinity"]
        (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == component
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert "affinity" not in pod_spec(pre)  # GPU pods: no spreading unless asked
    hard = pod_spec(one(objects("production"), "StatefulSet", "rel-baton-scheduler"))
    assert hard["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    own = objs("gateway.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
               ".nodeSelectorTerms[0].matchExpressions[0].key=pool",
               "gateway.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
               ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists")  # fmt: skip
    gateway = pod_spec(one(own, "Deployment", "rel-baton-gateway"))
    assert set(gateway["affinity"]) == {"nodeAffinity"}


# -- 11. the dashboard shows one release ----------------------------------------------------------


def board(found: list[dict[str, Any]]) -> dict[str, Any]:
    return json.loads(one(found, "ConfigMap", "rel-baton-dashboard")["data"]["baton.json"])  # type: ignore[no-any-return]


def test_11_every_dashboard_query_selects_the_release() -> None:
    b = board(objects("default"))
    exprs = [t["expr"] for p in b["panels"] for t in p["targets"]]
    assert len(exprs) >= 26
    for expr in exprs:
        series = re.findall(r"(baton_[a-z0-9_]+)(\{[^}]*\})?", expr)
        assert series, expr
        for metric, selector in series:
            assert 'namespace="$namespace"' in selector, (metric, expr)
            assert 'app_kubernetes_io_instance="$release"' in selector, (metric, expr)
    variables = {v["name"]: v for v in b["templating"]["list"]}
    assert variables["namespace"]["current"]["value"] == "serving"
    assert variables["release"]["current"]["value"] == "rel"
    other = json.loads(render(release="other").stdout.split("baton.json: |-")[1].split("\n---")[0])
    assert other["uid"] != b["uid"]  # two releases' dashboards never replace each other


# -- 12. server-side apply ------------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_12_ports_name_their_protocol_and_gpu_counts_are_integers(name: str) -> None:
    for o in objects(name):
        if o["kind"] == "Service":
            for p in o["spec"]["ports"]:
                assert p["protocol"] == "TCP", o["metadata"]["name"]
        for c in containers(o):
            for p in c.get("ports", []):
                assert p["protocol"] == "TCP", (o["metadata"]["name"], c["name"])
            for key, value in c.get("resources", {}).get("limits", {}).items():
                if key.endswith("/gpu"):
                    assert type(value) is int, (o["metadata"]["name"], key, value)
        if o["kind"] == "NetworkPolicy":
            for rule in o["spec"]["ingress"]:
                for p in rule.get("ports", []):
                    assert p["protocol"] == "TCP"


# -- what operators of other charts expect --------------------------------------------------------

EXTRAS = [
    "{c}.priorityClassName=high", "{c}.runtimeClassName=nvidia",
    "{c}.topologySpreadConstraints[0].maxSkew=1",
    "{c}.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
    "{c}.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
    "{c}.extraEnv[0].name=EXTRA", "{c}.extraEnv[0].valueFrom.secretKeyRef.name=s",
    "{c}.extraEnv[0].valueFrom.secretKeyRef.key=k", "{c}.envFrom[0].configMapRef.name=cm",
    "{c}.extraVolumes[0].name=extra", "{c}.extraVolumes[0].configMap.name=cm",
    "{c}.extraVolumeMounts[0].name=extra", "{c}.extraVolumeMounts[0].mountPath=/etc/extra",
    "{c}.annotations.team=serving", "{c}.podAnnotations.owner=ml", "{c}.podLabels.tier=gpu",
]  # fmt: skip


def test_every_component_takes_placement_env_volumes_and_annotations(tmp_path: Path) -> None:
    components = {"gateway": ("Deployment", "rel-baton-gateway"),
                  "scheduler": ("StatefulSet", "rel-baton-scheduler"),
                  "decode": ("Deployment", "rel-baton-decode")}  # fmt: skip
    sets = [s.format(c=c) for c in components for s in EXTRAS]
    found = objs(*sets, "decode.image.tag=9.9.9", "decode.strategy.type=Recreate",
                 "decode.strategy.rollingUpdate=null")  # fmt: skip
    for c, (kind, name) in components.items():
        o = one(found, kind, name)
        spec = pod_spec(o)
        assert spec["priorityClassName"] == "high" and spec["runtimeClassName"] == "nvidia", c
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
        main = spec["containers"][0]
        assert {"name": "EXTRA", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}} in \
            main["env"]  # fmt: skip
        assert main["envFrom"] == [{"configMapRef": {"name": "cm"}}]
        assert {"name": "extra", "configMap": {"name": "cm"}} in spec["volumes"]
        assert {"name": "extra", "mountPath": "/etc/extra"} in main["volumeMounts"]
        assert o["metadata"]["annotations"]["team"] == "serving"
        assert template(o)["metadata"]["annotations"]["owner"] == "ml"
        assert template(o)["metadata"]["labels"]["tier"] == "gpu"
    decode = one(found, "Deployment", "rel-baton-decode")
    assert pod_spec(decode)["containers"][0]["image"].endswith(":9.9.9")
    assert decode["spec"]["strategy"] == {"type": "Recreate"}
    prefill = pod_spec(one(found, "Deployment", "rel-baton-prefill"))["containers"][0]
    assert prefill["image"].endswith(":0.1.0")  # the other pool keeps image.worker
    path = tmp_path / "extras.yaml"
    path.write_text(render(*sets).stdout)
    validate = Path(helm()).parent / "kubernetes-validate"
    if not validate.exists():
        import sys

        validate = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(validate), "--strict", "-k", "1.33.0", str(path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(("setting", "message"), [
    ("decode.replica=2", "additional properties 'replica' not allowed"),
    ("gateway.podAnnotations.a=null", "podAnnotations"),
    ("decode.shmSizeLimit=16GB", "shmSizeLimit"),
    ("gateway.antiAffinity=sometimes", "antiAffinity"),
    ("decode.leaderWorkerSet.size=1", "size"),
    ("decode.image.pullPolicy=Sometimes", "pullPolicy"),
])  # fmt: skip
def test_the_schema_is_closed_where_a_typo_would_hide_a_mistake(setting: str, message: str) -> None:
    out = render(setting, ok=False)
    assert message in out.stderr, out.stderr


# -- workers larger than one node -----------------------------------------------------------------


def test_a_multi_node_worker_is_a_leader_worker_set_running_ray() -> None:
    found = objects("multinode")
    lws = one(found, "LeaderWorkerSet", "rel-baton-decode")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (ray,) = group["workerTemplate"]["spec"]["containers"]
    assert "ray start --head" in leader["command"][2] and 'exec baton "$@"' in leader["command"][2]
    assert arg(leader, "--tensor-parallel-size") == "16"  # 2 pods × 8 GPUs
    assert arg(leader, "--distributed-executor-backend") == "ray"
    env = {e["name"]: e.get("value") for e in leader["env"]}
    assert env["RAY_ADDRESS"] == "$(POD_IP):6379"
    assert "$LWS_LEADER_ADDRESS:$RAY_PORT" in ray["command"][2] and "--block" in ray["command"][2]
    for c in (leader, ray):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    # the autoscaler scales the groups; the budget covers every pod of the pool
    hpa = one(found, "HorizontalPodAutoscaler", "rel-baton-decode")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "name": "rel-baton-decode"}  # fmt: skip
    pdb = one(found, "PodDisruptionBudget", "rel-baton-decode")
    for t in (group["leaderTemplate"], group["workerTemplate"]):
        assert all(t["metadata"]["labels"][k] == v
                   for k, v in pdb["spec"]["selector"]["matchLabels"].items())  # fmt: skip
    # Ray and NCCL between a group's pods: the Ray workers admit the release's workers only
    ray_policy = one(found, "NetworkPolicy", "rel-baton-ray-workers")
    ray_labels = group["workerTemplate"]["metadata"]["labels"]
    assert selects(ray_policy["spec"]["podSelector"], ray_labels)
    leader_labels = group["leaderTemplate"]["metadata"]["labels"]
    (rule,) = ray_policy["spec"]["ingress"]
    assert admits(rule, leader_labels, {}, same_ns=True)
    assert not admits(rule, {"app": "curl"}, {}, same_ns=True)
    workers_rule = one(found, "NetworkPolicy", "rel-baton-workers")["spec"]["ingress"][1]
    assert admits(workers_rule, ray_labels, {}, same_ns=True)  # the Ray head hears its workers


def test_the_planner_cannot_scale_a_leader_worker_set() -> None:
    out = render("planner.enabled=true", "planner.scale=true", "decode.autoscaling.enabled=false",
                 values="multinode", ok=False)  # fmt: skip
    assert "leaderWorkerSet" in out.stderr


# -- the production example -----------------------------------------------------------------------


def test_the_docs_show_the_production_example_the_tests_render() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    values = (CHART / "ci" / "production-values.yaml").read_text()
    assert values in text, "docs/deploy.md must show charts/baton/ci/production-values.yaml"
    found = objects("production")
    assert {w["metadata"]["name"]: w["kind"] for w in workers(found)} == {
        "rel-baton-prefill": "Deployment", "rel-baton-decode": "Deployment"}  # fmt: skip
    hpas = {o["metadata"]["name"]: o["spec"]["minReplicas"] for o in found
            if o["kind"] == "HorizontalPodAutoscaler"}  # fmt: skip
    assert hpas == {"rel-baton-prefill": 2, "rel-baton-decode": 4}
    for w in workers(found):
        (c,) = pod_spec(w)["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert "--tensor-parallel-size" in c["args"]
        assert pod_spec(w)["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert one(found, "StatefulSet", "rel-baton-scheduler")["spec"]["replicas"] == 2


def test_a_cpu_worker_sees_no_gpu_through_the_nvidia_runtime() -> None:
    """The worker image sets NVIDIA_VISIBLE_DEVICES=all (as NVIDIA's images do): a pool of
    CPU workers overrides it, a GPU pool leaves it to the device plugin."""
    for name, want in (("cpu-demo", "void"), ("default", None)):
        for w in workers(objects(name)):
            (c,) = pod_spec(w)["containers"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env.get("NVIDIA_VISIBLE_DEVICES") == want, (name, w["metadata"]["name"])
