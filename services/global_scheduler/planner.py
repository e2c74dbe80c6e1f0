"""The planner: desired replicas per pool from the scaling signals, each pool on its own.

Signals, per pool (``pool_signals``, from the live registry only):

    prefill   seconds of prefill backlog: uncached prompt tokens queued on the pool ÷ the
              pool's measured prefill throughput (tokens per second of model time)
    decode    KV-cache occupancy (mean over the pool) and running + waiting requests per worker
    both      a colocated pool: the larger of the two

Each signal is divided by its target; the pool's pressure is the largest quotient. A pool
whose pressure is within ``tolerance`` of 1 stays as it is; otherwise it asks for
``ceil(serving × pressure)`` replicas, clamped to the pool's bounds. Then, as Kubernetes'
HPA does, and with the same defaults as the chart's autoscaling values:

- **stabilisation**: a scale-down takes the highest ask of the last
  ``scale_down_stabilization_s`` (a dip does not shrink the pool), a scale-up the lowest ask of
  the last ``scale_up_stabilization_s`` (a spike does not grow it): no flapping on a noisy
  plateau;
- **rates**: at most ``scale_up_pods`` more per ``scale_up_period_s`` and ``scale_down_pods``
  fewer per ``scale_down_period_s``;
- **the prefill:decode ratio** stays within ``[min_prefill_decode_ratio,
  max_prefill_decode_ratio]`` (the smaller pool is raised, never the larger one cut);
- **a GPU budget**: the pools together never ask for more than ``gpu_budget`` GPUs (scale-ups
  are cut, the least pressed pool first; nothing that runs is taken away for it);
- **drain before removal**: a pool scales down only by workers that have drained. The planner
  picks the least busy workers, the scheduler cordons them (no new routes), and the pool's
  desired replicas drop only once they are idle. Those are the ``removable`` workers, whose
  pods the scheduler marks as the ones to delete first when it sets replicas itself.

Pure (a clock is passed in): the scheduler calls ``plan`` every ``interval_s`` with what the
registry says, publishes the result on /metrics, and, when told to, sets the Deployments'
replicas through their scale subresource.
"""

import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

POOLS = ("prefill", "decode", "both")
PLANNER = "planner"  # the reason the planner cordons a worker, as the registry records it
DELETING = "pod-deleting"  # the reason pod discovery cordons one (discovery.py)
REMOVED_S = 600.0  # a pod given up that Kubernetes has not deleted after this routes again


@dataclass(frozen=True)
class WorkerSignal:
    worker_id: str
    pool: str  # prefill | decode | both
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    kv_usage: float = 0.0
    pending_prefill_tokens: int = 0
    tokens_per_s: float = 0.0
    cordoned: str = ""  # why it takes no new routes ("" routable)

    @property
    def busy(self) -> int:
        return self.running + self.waiting + self.in_flight


@dataclass(frozen=True)
class PoolSignals:
    workers: int  # serving: registered and not being deleted
    backlog_s: float
    kv_usage: float
    running: int
    waiting: int


def pool_signals(
    workers: list[WorkerSignal], default_tokens_per_s: float = 10_000.0
) -> dict[str, PoolSignals]:
    """Every pool, also empty ones (zeros: a pool that lost its workers shows no load)."""
    out = {}
    for pool in POOLS:
        ws = [w for w in workers if w.pool == pool and w.cordoned != DELETING]
        rates = [w.tokens_per_s for w in ws if w.tokens_per_s > 0]
        # a worker not measured yet counts at the mean of those measured (or the default)
        mean = sum(rates) / len(rates) if rates else default_tokens_per_s
        rate = sum(w.tokens_per_s if w.tokens_per_s > 0 else mean for w in ws)
        tokens = sum(w.pending_prefill_tokens for w in ws)
        out[pool] = PoolSignals(
            workers=len(ws),
            backlog_s=tokens / rate if rate > 0 else 0.0,
            kv_usage=sum(w.kv_usage for w in ws) / len(ws) if ws else 0.0,
            running=sum(w.running for w in ws),
            waiting=sum(w.waiting for w in ws),
        )
    return out


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 8
    gpus_per_replica: int = 1


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = 15.0
    prefill_backlog_target_s: float = 2.0
    decode_kv_usage_target: float = 0.75
    decode_running_target: float = 32.0  # running + waiting requests per decode worker
    tolerance: float = 0.1
    scale_up_pods: int = 1
    scale_up_period_s: float = 180.0
    scale_up_stabilization_s: float = 60.0
    scale_down_pods: int = 1
    scale_down_period_s: float = 300.0
    scale_down_stabilization_s: float = 300.0
    min_prefill_decode_ratio: float = 0.0  # 0: no lower bound
    max_prefill_decode_ratio: float = 0.0  # 0: no upper bound
    gpu_budget: int = 0  # 0: no budget
    default_tokens_per_s: float = 10_000.0  # a pool's throughput before any is measured
    pools: dict[str, PoolBounds] = field(default_factory=dict)  # default bounds for others

    def __post_init__(self) -> None:
        positive = ("interval_s", "prefill_backlog_target_s", "decode_kv_usage_target",
                    "decode_running_target", "default_tokens_per_s")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"planner: {name} must be > 0")
        if self.scale_up_pods < 1 or self.scale_down_pods < 1 or not 0 <= self.tolerance < 1:
            raise ValueError("planner: scale_*_pods must be >= 1 and tolerance in [0, 1)")
        lo, hi = self.min_prefill_decode_ratio, self.max_prefill_decode_ratio
        if lo < 0 or hi < 0 or (hi and lo > hi):
            raise ValueError("planner: prefill:decode ratio bounds must be >= 0 and min <= max")
        for pool, b in self.pools.items():
            if pool not in POOLS:
                raise ValueError(f"planner: unknown pool {pool!r} (pools: {', '.join(POOLS)})")
            if not 0 <= b.min_replicas <= b.max_replicas or b.gpus_per_replica < 0:
                raise ValueError(f"planner: pool {pool}: need 0 <= min_replicas <= max_replicas")

    def bounds(self, pool: str) -> PoolBounds:
        return self.pools.get(pool, PoolBounds())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlannerConfig":
        """From the chart's ConfigMap (YAML/JSON); an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"planner: unknown keys {unknown} (known: {sorted(known)})")
        pools = {}
        for pool, b in (data.get("pools") or {}).items():
            extra = sorted(set(b) - {f.name for f in fields(PoolBounds)})
            if extra:
                raise ValueError(f"planner: pool {pool}: unknown keys {extra}")
            pools[pool] = PoolBounds(**b)
        return cls(**{**data, "pools": pools})


@dataclass
class Plan:
    desired: dict[str, int]  # replicas per pool with workers or bounds
    pressure: dict[str, float]  # signal ÷ target, per pool
    drain: dict[str, list[str]]  # workers to empty (cordon) before the pool shrinks
    removable: dict[str, list[str]]  # drained: the pods to delete first


@dataclass
class _PoolState:
    asked: int  # the last desired replicas
    since: float  # first planned
    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, raw ask)
    last_up: float = -math.inf
    last_down: float = -math.inf
    victims: list[str] = field(default_factory=list)  # being emptied
    removed: dict[str, float] = field(default_factory=dict)  # drained and given up: when


class Planner:
    def __init__(self, config: PlannerConfig, drains_first: bool = True):
        """``drains_first``: shrink a pool only by workers emptied first (when the scheduler
        sets replicas itself and can say which pods go). Without it (HPA/KEDA act on the
        desired replicas and pick the pods), desired replicas drop at once and the workers'
        own drain on SIGTERM keeps the requests."""
        self.config = config
        self.drains_first = drains_first
        self._pools: dict[str, _PoolState] = {}

    def seed(self, pool: str, replicas: int, now: float) -> None:
        """Start a pool from the replicas it has (its Deployment says), not from the workers
        registered so far: a scheduler that just started sees few and must not shrink it."""
        if pool not in self._pools:
            self._pools[pool] = _PoolState(replicas, since=now)

    def pressure(self, pool: str, s: PoolSignals) -> float:
        c = self.config
        prefill = s.backlog_s / c.prefill_backlog_target_s
        per_worker = (s.running + s.waiting) / max(s.workers, 1)
        decode = max(s.kv_usage / c.decode_kv_usage_target, per_worker / c.decode_running_target)
        return {"prefill": prefill, "decode": decode}.get(pool, max(prefill, decode))

    def plan(
        self, now: float, signals: dict[str, PoolSignals], workers: list[WorkerSignal]
    ) -> Plan:
        c = self.config
        pools = [p for p in POOLS if signals[p].workers or p in c.pools or p in self._pools]
        pressure = {p: self.pressure(p, signals[p]) for p in pools}
        target: dict[str, int] = {}
        for p in pools:
            st = self._pools.setdefault(p, _PoolState(signals[p].workers, since=now))
            serving = signals[p].workers
            raw = self._raw(p, serving, pressure[p], st.asked)
            st.history.append((now, raw))
            keep = max(c.scale_down_stabilization_s, c.scale_up_stabilization_s)
            while st.history and st.history[0][0] < now - keep:
                st.history.popleft()
            # a window not watched whole yet counts as asking for no change
            down = max(r for t, r in st.history if t >= now - c.scale_down_stabilization_s)
            if now - st.since < c.scale_down_stabilization_s:
                down = max(down, st.asked)
            up = min(r for t, r in st.history if t >= now - c.scale_up_stabilization_s)
            if now - st.since < c.scale_up_stabilization_s:
                up = min(up, st.asked)
            if up > st.asked:
                target[p] = up
            elif down < st.asked:
                target[p] = down
            else:
                target[p] = st.asked
        self._ratio(target)
        for p in pools:  # rates
            st, goal = self._pools[p], target[p]
            if goal > st.asked:
                soon = now - st.last_up < c.scale_up_period_s
                goal = st.asked if soon else min(goal, st.asked + c.scale_up_pods)
            elif goal < st.asked:
                soon = now - st.last_down < c.scale_down_period_s
                goal = st.asked if soon else max(goal, st.asked - c.scale_down_pods)
            target[p] = goal
        self._budget(target, pressure)
        return self._drain(now, target, pressure, workers)

    def _raw(self, pool: str, serving: int, pressure: float, asked: int) -> int:
        b, tol = self.config.bounds(pool), self.config.tolerance
        if serving == 0:
            ask = asked  # nothing measured: keep what was asked (pods may still be loading)
        elif abs(pressure - 1.0) <= tol:
            ask = serving
        else:
            ask = math.ceil(serving * pressure)
        if asked > serving and pressure >= 1.0 - tol:
            ask = max(ask, asked)  # pods asked for are still starting: don't cancel them
        return min(max(ask, b.min_replicas), b.max_replicas)

    def _ratio(self, target: dict[str, int]) -> None:
        lo, hi = self.config.min_prefill_decode_ratio, self.config.max_prefill_decode_ratio
        if "prefill" not in target or "decode" not in target:
            return
        p, d = target["prefill"], target["decode"]
        if lo and p < d * lo:
            target["prefill"] = min(math.ceil(d * lo), self.config.bounds("prefill").max_replicas)
        if hi and p > d * hi:
            target["decode"] = min(math.ceil(p / hi), self.config.bounds("decode").max_replicas)

    def _budget(self, target: dict[str, int], pressure: dict[str, float]) -> None:
        budget = self.config.gpu_budget
        if not budget:
            return

        def gpus() -> int:
            return sum(n * self.config.bounds(p).gpus_per_replica for p, n in target.items())

        while gpus() > budget:
            growing = [p for p in target if target[p] > self._pools[p].asked]
            if not growing:
                return  # what runs already is over budget: ask for nothing more, cut nothing
            least = min(growing, key=lambda p: pressure[p])
            target[least] -= 1

    def _drain(
        self,
        now: float,
        target: dict[str, int],
        pressure: dict[str, float],
        workers: list[WorkerSignal],
    ) -> Plan:
        desired: dict[str, int] = {}
        drain: dict[str, list[str]] = {}
        removable: dict[str, list[str]] = {}
        for p, goal in target.items():
            st = self._pools[p]
            pool = [w for w in workers if w.pool == p and w.cordoned != DELETING]
            # pods already given up stay cordoned until Kubernetes deletes them (bounded)
            ids = {w.worker_id for w in pool}
            st.removed = {v: t for v, t in st.removed.items() if v in ids and now - t < REMOVED_S}
            ws = [w for w in pool if w.worker_id not in st.removed]
            excess = len(ws) - goal
            if goal >= st.asked or excess <= 0 or not self.drains_first:
                if goal > st.asked:
                    st.last_up = now
                elif goal < st.asked:
                    st.last_down = now
                st.asked, st.victims = goal, []
            else:  # shrink by drained workers only
                alive = {w.worker_id: w for w in ws}
                st.victims = [v for v in st.victims if v in alive][:excess]
                others = sorted((w for w in ws if w.worker_id not in st.victims),
                                key=lambda w: (w.busy, w.kv_usage, w.worker_id))  # fmt: skip
                st.victims += [w.worker_id for w in others[: excess - len(st.victims)]]
                done = [v for v in st.victims
                        if alive[v].cordoned == PLANNER and alive[v].busy == 0]  # fmt: skip
                if done:
                    st.asked = max(len(ws) - len(done), goal)
                    st.last_down = now
                    st.removed.update(dict.fromkeys(done, now))
                    st.victims = [v for v in st.victims if v not in done]
                removable[p] = done
            desired[p] = st.asked
            drain[p] = st.victims + list(st.removed)
            removable.setdefault(p, [])
        return Plan(desired, pressure, drain, removable)
