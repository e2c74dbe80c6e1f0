"""Writes charts/baton/files/dashboard.json, the Grafana dashboard the chart ships as a
ConfigMap (``python charts/dashboard.py``; a test checks the file is what this writes).
``__TTFT_SLO__`` and ``__ITL_SLO__`` are filled in by the chart from monitoring.slo,
``__NAMESPACE__``, ``__RELEASE__`` and ``__UID__`` from the release: every query selects the
release's series (``namespace``, and ``app_kubernetes_io_instance``, which the chart's monitors
set and a pod-label map of annotation scrapes makes), so two releases never mix, and each
release's dashboard has its own uid."""

import json
from pathlib import Path

OUT = Path(__file__).parent / "baton" / "files" / "dashboard.json"


RELEASE = 'namespace="$namespace",app_kubernetes_io_instance="$release"'


def m(metric: str, matchers: str = "") -> str:
    """A series of this release (and ``matchers``)."""
    return f"{metric}{{{RELEASE}{',' + matchers if matchers else ''}}}"


def q(expr: str, legend: str) -> dict[str, str]:
    return {"expr": expr, "legendFormat": legend}


def pct(metric: str) -> list[dict[str, str]]:
    rate = f"sum(rate({m(metric + '_bucket')}[5m])) by (le)"
    return [q(f"histogram_quantile({p}, {rate})", f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)]


def share(metric: str, slo: str) -> dict[str, str]:
    bucket, count = m(f"{metric}_bucket", f'le="{slo}"'), m(f"{metric}_count")
    return q(f"sum(rate({bucket}[5m])) / sum(rate({count}[5m]))",
             f"{metric.split('_')[2].upper()} ≤ {slo} s")  # fmt: skip


PANELS: list[tuple[str, str, list[dict[str, str]]]] = [
    ("Time to first token", "s", pct("baton_gateway_ttft_seconds")),
    ("Inter-token latency", "s", pct("baton_gateway_itl_seconds")),
    ("End-to-end latency", "s", pct("baton_gateway_e2e_seconds")),
    ("Goodput: share of requests within the SLOs (from histogram buckets)", "percentunit",
     [share("baton_gateway_ttft_seconds", "__TTFT_SLO__"),
      share("baton_gateway_itl_seconds", "__ITL_SLO__")]),
    ("Requests by outcome", "reqps",
     [q(f"sum(rate({m('baton_gateway_requests_total')}[1m])) by (outcome)", "{{outcome}}")]),
    ("Route decisions", "ops",
     [q(f"sum(rate({m('baton_scheduler_route_decisions_total')}[1m])) by (outcome, factor)",
        "{{outcome}} ({{factor}})"),
      q(f"sum(rate({m('baton_scheduler_prefill_decisions_total')}[1m])) by (decision, reason)",
        "prefill {{decision}} ({{reason}})")]),
    ("Prefix-hit tokens: predicted vs reused", "short",
     [q(f"sum(rate({m('baton_scheduler_predicted_prefix_hit_tokens_total')}[5m])) by (source)",
        "predicted ({{source}})"),
      q(f"sum(rate({m('baton_scheduler_engine_prefix_hit_tokens_total')}[5m]))",
        "reused by engines")]),
    ("KV-cache usage per pool", "percentunit",
     [q(f"max({m('baton_pool_kv_usage')}) by (pool)", "{{pool}}")]),
    ("Running and waiting per pool", "short",
     [q(f"max({m('baton_pool_running_requests')}) by (pool)", "running {{pool}}"),
      q(f"max({m('baton_pool_waiting_requests')}) by (pool)", "waiting {{pool}}")]),
    ("Prefill backlog per pool", "s",
     [q(f"max({m('baton_pool_prefill_backlog_seconds')}) by (pool)", "{{pool}}")]),
    ("KV transfer: mean pull time", "s",
     [q(f"sum(rate({m('baton_worker_kv_pull_seconds_total')}[5m])) / "
        f"sum(rate({m('baton_worker_kv_pulls_total')}[5m]))", "mean pull")]),
    ("KV transfer: bytes", "Bps",
     [q(f"sum(rate({m('baton_worker_kv_pull_bytes_total')}[5m]))", "pulled"),
      q(f"sum(rate({m('baton_worker_kv_pull_failures_total')}[5m]))", "failed pulls/s")]),
    ("Resumes after worker failures", "ops",
     [q(f"sum(rate({m('baton_gateway_resumes_total')}[5m])) by (stage)", "resumed {{stage}}")]),
    ("Replicas per pool: planner's desired vs registered", "short",
     [q(f"max({m('baton_planner_desired_replicas')}) by (pool)", "desired {{pool}}"),
      q(f"max({m('baton_pool_workers')}) by (pool)", "registered {{pool}}")]),
]  # fmt: skip


def dashboard() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{**t, "refId": chr(65 + j)} for j, t in enumerate(targets)],
        })  # fmt: skip
    return {
        "title": "Baton (__NAMESPACE__/__RELEASE__)", "uid": "baton-__UID__",
        "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "tags": ["baton"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus"},
            # the release this dashboard was installed with (another one: type its names)
            {"name": "namespace", "type": "textbox", "label": "Namespace",
             "query": "__NAMESPACE__", "current": {"text": "__NAMESPACE__",
                                                   "value": "__NAMESPACE__"}},
            {"name": "release", "type": "textbox", "label": "Release",
             "query": "__RELEASE__", "current": {"text": "__RELEASE__", "value": "__RELEASE__"}},
        ]},
        "panels": panels,
    }  # fmt: skip


def render() -> str:
    return json.dumps(dashboard(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
