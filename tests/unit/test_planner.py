"""The planner on recorded load traces: a step up, a noisy plateau that must not flap, a step
down that waits for the worker it empties, and the ratio and GPU-budget bounds."""

import itertools
import math
import random

import pytest

from services.global_scheduler.planner import (
    DELETING,
    PLANNER,
    Planner,
    PlannerConfig,
    PoolBounds,
    WorkerSignal,
    pool_signals,
)

TICK = 15.0  # the planner's default interval


def decode_workers(n: int, demand: float, cordoned: dict[str, str] | None = None,
                   busy_override: dict[str, int] | None = None) -> list[WorkerSignal]:  # fmt: skip
    """n decode workers sharing ``demand`` running requests evenly (cordoned ones get none)."""
    cordoned = cordoned or {}
    names = [f"decode-{i}" for i in range(n)]
    routable = [w for w in names if not cordoned.get(w)] or names
    out = []
    for name in names:
        running = round(demand / len(routable)) if name in routable else 0
        if busy_override and name in busy_override:
            running = busy_override[name]
        out.append(WorkerSignal(name, "decode", running=running, kv_usage=0.3,
                                cordoned=cordoned.get(name, "")))  # fmt: skip
    return out


def run_trace(planner: Planner, demand_at, seconds: float, start_workers: int,  # type: ignore[no-untyped-def]
              load_delay_s: float = 120.0) -> list[tuple[float, int, int]]:  # fmt: skip
    """Simulate a decode pool: pods asked for join ``load_delay_s`` later. Returns
    (time, desired, serving) per tick."""
    serving, joins, out = start_workers, [], []
    t = 0.0
    while t <= seconds:
        while joins and joins[0] <= t:
            joins.pop(0)
            serving += 1
        ws = decode_workers(serving, demand_at(t))
        plan = planner.plan(t, pool_signals(ws), ws)
        want = plan.desired["decode"]
        pending = serving + len(joins)
        for _ in range(want - pending):
            joins.append(t + load_delay_s)
        out.append((t, want, serving))
        t += TICK
    return out


def config(**kw) -> PlannerConfig:  # type: ignore[no-untyped-def]
    pools = {"decode": PoolBounds(1, 16), "prefill": PoolBounds(1, 16)}
    return PlannerConfig(**{"pools": pools, **kw})


def test_step_up_one_pod_per_period_after_the_up_window_to_what_the_load_needs() -> None:
    target = PlannerConfig().decode_running_target  # 32 per worker
    trace = run_trace(Planner(config()), lambda t: 2 * target if t < 300 else 6 * target,
                      seconds=3600, start_workers=2)  # fmt: skip
    before = [d for t, d, _ in trace if t < 300]
    assert set(before) == {2}  # at the target: nothing moves
    ups = [(t, d) for (t, d, _), (_, prev, _) in zip(trace[1:], trace, strict=False) if d > prev]
    assert ups, "never scaled up"
    assert ups[0][0] >= 300 + PlannerConfig().scale_up_stabilization_s  # not on one sample
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(ups)]
    assert all(g >= PlannerConfig().scale_up_period_s for g in gaps)  # 1 pod / 180 s
    assert all(b[1] - a[1] == 1 for a, b in itertools.pairwise(ups))
    assert trace[-1][1] == 6 and trace[-1][2] == 6  # what 6 × target needs, and no more
    assert max(d for _, d, _ in trace) == 6  # starting pods were not counted twice


def test_noisy_plateau_does_not_flap() -> None:
    rng = random.Random(7)
    target = PlannerConfig().decode_running_target
    planner = Planner(config())

    def demand(t: float) -> float:
        noise = rng.uniform(-0.08, 0.08)  # inside the tolerance
        spike = rng.random()
        if spike < 0.05:
            noise = 0.4  # one sample far above
        elif spike < 0.10:
            noise = -0.5  # one sample far below
        return 4 * target * (1 + noise)

    trace = run_trace(planner, demand, seconds=2 * 3600, start_workers=4)
    assert {d for _, d, _ in trace} == {4}


def test_step_down_waits_for_the_worker_it_empties() -> None:
    planner = Planner(config())  # drains first: the scheduler sets replicas itself
    cordoned: dict[str, str] = {}
    still_busy = {"decode-0": 5}  # its requests take a while to finish
    t, seen_drain, removed = 0.0, [], []
    n = 4
    while t < 1500:
        held = {k: v for k, v in still_busy.items() if k in cordoned}
        ws = decode_workers(n, demand=8, cordoned=cordoned, busy_override=held)
        plan = planner.plan(t, pool_signals(ws), ws)
        for name in plan.drain["decode"]:
            cordoned[name] = PLANNER
        if plan.drain["decode"]:
            seen_drain.append((t, plan.desired["decode"], list(plan.drain["decode"])))
        if any(cordoned.get(w.worker_id) == PLANNER and w.busy for w in ws):
            assert plan.desired["decode"] == n, "shrank while the emptied worker was busy"
            assert not plan.removable["decode"]
        if plan.removable["decode"]:
            removed += plan.removable["decode"]
            assert plan.desired["decode"] == n - 1
            break
        if t >= 600:
            still_busy = {}  # its last requests end
        t += TICK
    assert seen_drain and seen_drain[0][0] >= PlannerConfig().scale_down_stabilization_s
    assert removed == [seen_drain[0][2][0]] and removed[0] in cordoned
    assert t >= 600  # not before its requests ended


def test_publish_only_drops_desired_without_emptying_first() -> None:
    planner = Planner(config(), drains_first=False)  # HPA/KEDA pick the pods
    t, desired = 0.0, []
    while t < 900:
        ws = decode_workers(4, demand=8)
        plan = planner.plan(t, pool_signals(ws), ws)
        assert plan.drain["decode"] == []
        desired.append(plan.desired["decode"])
        t += TICK
    assert desired[0] == 4 and desired[-1] < 4
    assert sorted(desired, reverse=True) == desired  # monotone: no flapping on the way down


def test_prefill_decode_ratio_bound_raises_the_smaller_pool() -> None:
    planner = Planner(config(min_prefill_decode_ratio=0.5, scale_up_stabilization_s=0,
                             scale_up_period_s=0))  # fmt: skip
    target = PlannerConfig().decode_running_target
    plan = None
    for i in range(10):
        ws = [*decode_workers(4, demand=8 * target), WorkerSignal("prefill-0", "prefill")]
        plan = planner.plan(i * TICK, pool_signals(ws), ws)
    assert plan is not None
    assert plan.pressure["prefill"] == 0.0  # no prefill backlog at all
    d, p = plan.desired["decode"], plan.desired["prefill"]
    assert d > 4 and p >= math.ceil(d * 0.5) and p > 1


def test_gpu_budget_is_never_exceeded() -> None:
    pools = {"decode": PoolBounds(1, 16, gpus_per_replica=1),
             "prefill": PoolBounds(1, 16, gpus_per_replica=2)}  # fmt: skip
    planner = Planner(PlannerConfig(pools=pools, gpu_budget=10, scale_up_stabilization_s=0,
                                    scale_up_period_s=0))  # fmt: skip
    target = PlannerConfig().decode_running_target
    for i in range(40):
        prefill = WorkerSignal("prefill-0", "prefill", pending_prefill_tokens=500_000,
                               tokens_per_s=10_000)  # fmt: skip
        ws = [*decode_workers(2, demand=20 * target), prefill]
        plan = planner.plan(i * TICK, pool_signals(ws), ws)
        gpus = plan.desired["decode"] + 2 * plan.desired["prefill"]
        assert gpus <= 10, plan.desired
    assert gpus == 10  # it used the budget (both pools were pressed far beyond it)


def test_pool_signals_count_only_live_workers() -> None:
    ws = [
        WorkerSignal("p0", "prefill", pending_prefill_tokens=30_000, tokens_per_s=10_000),
        WorkerSignal("p1", "prefill", pending_prefill_tokens=10_000),  # not measured yet
        WorkerSignal("p2", "prefill", pending_prefill_tokens=99_999, cordoned=DELETING),
        WorkerSignal("d0", "decode", running=10, waiting=2, kv_usage=0.5),
    ]
    s = pool_signals(ws)
    assert s["prefill"].workers == 2 and s["prefill"].backlog_s == pytest.approx(2.0)
    assert s["decode"].kv_usage == 0.5 and s["decode"].running == 10 and s["decode"].waiting == 2
    assert s["both"].workers == 0 and s["both"].backlog_s == 0.0  # empty pool reads 0


def test_config_names_a_wrong_key() -> None:
    with pytest.raises(ValueError, match="scale_up_pod"):
        PlannerConfig.from_dict({"scale_up_pod": 2})
    with pytest.raises(ValueError, match="min_replicas"):
        PlannerConfig.from_dict({"pools": {"decode": {"min_replicas": 5, "max_replicas": 2}}})
    with pytest.raises(ValueError, match="unknown pool"):
        PlannerConfig.from_dict({"pools": {"gpu": {}}})
    assert PlannerConfig.from_dict({"gpu_budget": 8}).gpu_budget == 8


def test_a_scheduler_just_started_keeps_the_replicas_its_deployment_has() -> None:
    """Seeded from the Deployment (4), with one worker registered so far at the target load:
    no scale-down to what it happens to see."""
    planner = Planner(config())
    planner.seed("decode", 4, 0.0)
    target = PlannerConfig().decode_running_target
    for i in range(60):
        ws = decode_workers(1, demand=target)
        assert planner.plan(i * TICK, pool_signals(ws), ws).desired["decode"] == 4
