"""``baton serve``: the whole system as processes on this machine.

    global scheduler ──ready file──▶ N workers ──ready files──▶ gateway ──/ready──▶ print URL
                                     (the gateway starts with the workers, loading its tokenizer)

The launcher takes a frozen ``ClusterSpec`` (``baton/service_cli.py`` builds one from the
flags; ``baton/serving.py`` runs one for tests and benchmarks) and imports nothing of the
command line. Each child is a plain ``baton <service>`` process (what a Kubernetes pod runs).
Every wait is bounded and notices a child that exits. Ctrl-C (or SIGTERM) stops the gateway
first, then the workers (they drain), then the scheduler; anything still alive after the bound
is killed.

Supervision: a child that dies while serving is started again with the same flags (the
scheduler on the port it had, so workers and the gateway reconnect to it) after a backoff
(``RestartPolicy``: 0.5 s, doubling up to 8 s), and the others keep serving meanwhile. A child
that dies more than ``max_restarts`` times within ``window_s`` is given up on: a worker stays
down (the others serve), the scheduler or the gateway stops everything. Every death, restart
and recovery is one log line.
"""

import ctypes
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.affinity import assign_cpus
from shared.gguf_files import default_model_name
from shared.internal_auth import TLS_DIR_ENV, TOKEN_ENV, TOKEN_FILE_ENV
from shared.tmpdirs import make_private_dir

SCHEDULER_START_S = 30.0
WORKER_START_S = 600.0
GATEWAY_START_S = 60.0
STOP_S = 20.0


try:  # loaded here, not in the forked child (no dlopen between fork and exec)
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None  # not Linux: Ctrl-C and stop() still stop the children


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a service started later (tests, benchmarks).
    Drawn below Linux's ephemeral range (32768+), where the port-0 binds of the services
    themselves land, so one of them cannot take it in the meantime."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class RestartPolicy:
    """How ``baton serve`` restarts a child that died: after ``delay_s``, doubling with each
    death within ``window_s`` up to ``max_delay_s``; more than ``max_restarts`` deaths within
    ``window_s`` and it is given up on (``max_restarts=0``: never restart)."""

    max_restarts: int = 5
    delay_s: float = 0.5
    max_delay_s: float = 8.0
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.delay_s < 0 or self.max_delay_s < self.delay_s:
            raise ValueError("max_restarts and delay_s must be >= 0, max_delay_s >= delay_s")

    def delay(self, recent_deaths: int) -> float | None:
        """Seconds to wait before the next start, or None: give up."""
        if recent_deaths > self.max_restarts:
            return None
        return min(self.delay_s * 2 ** (recent_deaths - 1), self.max_delay_s)


@dataclass
class _Child:
    """How to start one child again, and its restart bookkeeping."""

    argv: list[str]
    ready: bool
    env: dict[str, str] | None
    deaths: list[float]  # monotonic times of its deaths within the policy's window
    due: float | None = None  # when it is to be started again
    starting: float | None = None  # the deadline of a restart that is not ready yet


@dataclass(frozen=True)
class ClusterSpec:
    """What ``baton serve`` starts: the flags of ``baton serve``, parsed once."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"  # the gateway's
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # the gateway reads its keys from this file itself: they stay off every command line
    api_key_file: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout: float = 600.0
    generate_stream: bool = True  # False: one unary Generate per request
    workers: int | None = None  # colocated (role both); None: 1 unless a P/D pool is asked for
    prefill_workers: int = 0
    decode_workers: int = 0
    worker_metrics: bool = False  # give each worker /metrics
    drain_timeout_s: float = 30.0  # a worker's SIGTERM: how long in-flight requests may finish
    step_timeout_s: float = 60.0  # a worker's engine with work and no progress: hung (watchdog)
    log_dir: str | None = None  # each service's output to DIR/<name>.log
    redis_url: str | None = None
    routing_policy: str | None = None  # a YAML/JSON file
    gpus: str | None = None  # comma-separated ids; None: CUDA_VISIBLE_DEVICES, else nvidia-smi
    pin_cpus: str | None = None  # "auto" or a CPU list (shared/affinity.assign_cpus)
    device: str = "auto"
    kv_sized: bool = False  # the engine flags give the KV cache an explicit size
    tensor_parallel_size: int = 1  # each worker's ranks: it gets this many GPUs
    prefill_tensor_parallel_size: int | None = None  # the prefill pool's (None: the above)
    decode_tensor_parallel_size: int | None = None  # the decode pool's (None: the above)
    engine_argv: tuple[str, ...] = ()  # the engine flags every worker gets, as argv
    gateway_argv: tuple[str, ...] = ()  # flags the gateway gets besides those above (limits,
    # --tool-call-parser)
    restart: RestartPolicy = RestartPolicy()
    internal_token_file: str | None = None  # None: $BATON_INTERNAL_TOKEN(_FILE), else a new one
    internal_tls_dir: str | None = None  # None: $BATON_INTERNAL_TLS_DIR, else no TLS


def worker_gpus(gpus: list[str], first: int, tp: int) -> list[str]:
    """A worker's ``tp`` GPUs from the ``first``-th on, in turn round the list (workers share
    GPUs only when they need more than there are)."""
    return [gpus[(first + k) % len(gpus)] for k in range(tp)]


class Cluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.engine_argv = list(spec.engine_argv)
        self.tmp = make_private_dir("baton-serve-")  # removed by stop(); stale ones at start
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, dict] = {}  # name → what it wrote when ready (address, ports)
        self.children: dict[str, _Child] = {}
        self.restarts: dict[str, int] = {}  # name → how many times it was started again
        self._stopping = False
        self._lock = threading.Lock()  # stop() against a restart from the supervisor thread
        self._supervisor: threading.Thread | None = None
        self.url: str | None = None  # the OpenAI base URL, once started
        self.security_env = self._security_env()  # every child's: the internal token, TLS

    def run(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._interrupt())
        failed = False
        try:
            url = self.start()
            print(f"Baton is serving {self.model_name} at {url}  (Ctrl-C stops it)", flush=True)
            self._supervise()
        except KeyboardInterrupt:
            pass
        except (RuntimeError, TimeoutError) as e:
            print(f"baton serve: {e}", file=sys.stderr)
            failed = True
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C cannot cut the stop
                signal.signal(sig, signal.SIG_IGN)
            self.stop()
        if failed:
            sys.exit(1)

    @property
    def model_name(self) -> str:
        return self.spec.served_model_name or default_model_name(self.spec.model)

    def start(self) -> str:
        """Start everything and return the OpenAI base URL; on failure nothing is left running."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        a = self.spec
        roles = self.worker_roles()
        cpus = self.cpus(["scheduler", *(name for name, _ in roles), "gateway"])
        argv = ["global-scheduler", "--port", "0", "--metrics-port", "0", *cpus["scheduler"]]
        if a.redis_url:
            argv += ["--redis-url", a.redis_url]
        if a.routing_policy:
            argv += ["--routing-policy", a.routing_policy]
        sched = self.spawn("scheduler", argv, ready=True)
        ready = self.wait_ready("scheduler", sched, SCHEDULER_START_S)
        sched_addr = ready["address"]
        # started again, it takes the same ports: the workers and the gateway reconnect to it
        port = sched_addr.rsplit(":", 1)[1]
        self.children["scheduler"].argv[1:5] = ["--port", port, "--metrics-port",
                                                str(ready["metrics_port"])]  # fmt: skip
        workers = []
        gpus = self.gpus()
        sizes = [self.worker_tp(role) for _, role in roles]
        if gpus and len(gpus) < max(sizes):
            raise RuntimeError(f"tensor parallel size {max(sizes)} needs as many GPUs per "
                               f"worker; {len(gpus)} found ({','.join(gpus)})")  # fmt: skip
        if gpus and sum(sizes) > len(gpus) and not a.kv_sized:
            print(f"baton serve: {len(roles)} workers share {len(gpus)} GPU(s), and each sizes "
                  "its KV cache from the memory it finds free: give each a size "
                  "(--kv-cache-memory-bytes or --num-kv-blocks)", file=sys.stderr)  # fmt: skip
        first_gpu = 0
        for (name, role), tp in zip(roles, sizes, strict=True):
            argv = ["worker", "--model", a.model, "--scheduler", sched_addr, "--worker-id", name,
                    "--role", role, "--drain-timeout", str(a.drain_timeout_s),
                    "--step-timeout", str(a.step_timeout_s)]  # fmt: skip
            if a.worker_metrics:
                argv += ["--metrics-port", "0"]
            argv += cpus[name]
            env = {"OMP_NUM_THREADS": str(self._threads_per_worker())}
            if gpus:  # tp GPUs each, round robin: P/D pools land on different GPUs
                env["CUDA_VISIBLE_DEVICES"] = ",".join(worker_gpus(gpus, first_gpu, tp))
                first_gpu += tp
            tp_argv = ["--tensor-parallel-size", str(tp)]  # (after the others: it wins)
            workers.append((name, self.spawn(name, argv + self.engine_argv + tp_argv, True, env)))
        # the gateway starts beside the workers (it loads its tokenizer meanwhile) and is
        # ready once it knows a worker
        argv = ["gateway", "--model", a.model, "--scheduler", sched_addr, "--host", a.host,
                "--port", str(a.port), "--served-model-name", self.model_name,
                "--max-body-bytes", str(a.max_body_bytes),
                "--request-timeout", str(a.request_timeout)]  # fmt: skip
        keys = self._api_key_file()
        argv += ["--api-key-file", keys] if keys else []
        argv += [] if a.generate_stream else ["--no-generate-stream"]
        argv += a.gateway_argv
        self.spawn("gateway", argv + cpus["gateway"], ready=False)
        for name, path in workers:
            self.wait_ready(name, path, WORKER_START_S)
        url = f"http://{a.host}:{a.port}"
        self.wait_http("gateway", f"{url}/ready", GATEWAY_START_S)
        self.url = f"{url}/v1"
        return self.url

    def supervise_in_background(self) -> None:
        """Restart dead children from a thread (``serving``: the caller's thread is its own)."""
        self._supervisor = threading.Thread(target=self._supervise_quietly, daemon=True,
                                            name="baton-supervisor")  # fmt: skip
        self._supervisor.start()

    def _supervise_quietly(self) -> None:
        try:
            self._supervise()
        except RuntimeError as e:  # given up on the scheduler or the gateway: it stays down
            print(f"baton serve: {e}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop the children in order: gateway, workers, scheduler (each bounded)."""
        with self._lock:
            self._stopping = True
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        workers = [n for n in self.procs if n not in ("gateway", "scheduler")]
        for group in (["gateway"], workers, ["scheduler"]):
            procs = [self.procs[n] for n in group if n in self.procs]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_S
            for p in procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        shutil.rmtree(self.tmp, ignore_errors=True)
        print("baton serve: stopped", flush=True)

    def _api_key_file(self) -> str | None:
        """The gateway's keys as a file (never on its command line, where ``ps`` shows them):
        ``--api-key-file`` as given, or, with ``--api-key`` values, a private file of those and
        the given file's keys."""
        a = self.spec
        if not a.api_keys:
            return str(Path(a.api_key_file).resolve()) if a.api_key_file else None
        lines = list(a.api_keys)
        if a.api_key_file:
            lines += Path(a.api_key_file).read_text().splitlines()
        path = self.tmp / "api-keys"  # (the private dir is the owner's only; so is the file)
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return str(path)

    def _security_env(self) -> dict[str, str]:
        """The secret every child shares (in the environment, never on a command line): the
        token file or token given, else one made now for this run; and the TLS directory."""
        a, env = self.spec, {}
        token_file = a.internal_token_file or os.environ.get(TOKEN_FILE_ENV)
        if token_file:
            env[TOKEN_FILE_ENV] = token_file
        else:
            env[TOKEN_ENV] = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
        tls_dir = a.internal_tls_dir or os.environ.get(TLS_DIR_ENV)
        if tls_dir:
            env[TLS_DIR_ENV] = tls_dir
        return env

    def _interrupt(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the first signal stops; later ones wait
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    def _threads_per_worker(self) -> int:
        """CPU threads for each worker's engine: the cores shared out, so N engines on one
        machine do not oversubscribe it (OpenMP spinning on shared cores is many times slower).
        An explicit OMP_NUM_THREADS wins."""
        if "OMP_NUM_THREADS" in os.environ:
            return int(os.environ["OMP_NUM_THREADS"])
        ranks = sum(self.worker_tp(role) for _, role in self.worker_roles())
        return max(1, (os.cpu_count() or 1) // max(1, ranks))

    def worker_tp(self, role: str) -> int:
        """The tensor-parallel size of a worker of ``role`` (its pool's, else everyone's)."""
        a = self.spec
        pool = {"prefill": a.prefill_tensor_parallel_size,
                "decode": a.decode_tensor_parallel_size}.get(role)  # fmt: skip
        return pool or a.tensor_parallel_size

    def cpus(self, names: list[str]) -> dict[str, list[str]]:
        """Each service's ``--cpus`` flag: one CPU of its own with ``--pin-cpus``, else none."""
        spec = self.spec.pin_cpus
        if spec is None:
            return {name: [] for name in names}
        try:
            chosen = assign_cpus(names, spec)
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        print("baton serve: " + ", ".join(f"{n} on CPU {c}" for n, c in chosen.items()),
              flush=True)  # fmt: skip
        return {name: ["--cpus", str(cpu)] for name, cpu in chosen.items()}

    def gpus(self) -> list[str]:
        """The GPUs the workers are spread over: ``--gpus``, else CUDA_VISIBLE_DEVICES, else
        every GPU ``nvidia-smi`` lists; none with ``--device cpu`` or on a machine without."""
        if self.spec.device == "cpu":
            return []
        spec = self.spec.gpus
        spec = os.environ.get("CUDA_VISIBLE_DEVICES") if spec is None else spec
        if spec is not None:
            return [g for g in spec.split(",") if g.strip()]
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return []
        return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]

    def worker_roles(self) -> list[tuple[str, str]]:
        """(name, role) of every worker: ``--prefill-workers`` P, ``--decode-workers`` D and
        ``--workers`` N colocated (default 1 when no P/D pool is asked for)."""
        a = self.spec
        both = (
            a.workers
            if a.workers is not None
            else (0 if a.prefill_workers or a.decode_workers else 1)
        )
        roles = [("prefill", a.prefill_workers), ("decode", a.decode_workers), ("both", both)]
        names = {"prefill": "prefill", "decode": "decode", "both": "worker"}
        if not both and not a.decode_workers:
            raise ValueError(
                "a cluster needs a decode-capable worker (--decode-workers or --workers)"
            )
        return [(f"{names[r]}-{i}", r) for r, n in roles for i in range(n)]

    def spawn(
        self, name: str, argv: list[str], ready: bool, env: dict[str, str] | None = None
    ) -> Path:
        """Start ``baton <argv>`` as the child ``name`` (stopped by ``stop``); with ``ready``,
        it writes the returned path when it serves (``wait_ready`` reads it)."""
        ready_file = self.tmp / f"{name}.json"
        ready_file.unlink(missing_ok=True)  # a previous run's (a restart)
        child = self.children.get(name)
        self.children[name] = _Child(list(argv), ready, env, child.deaths if child else [])
        cmd = [sys.executable, "-m", "baton.cli", *argv]
        if ready:
            cmd += ["--ready-file", str(ready_file)]
        # Ctrl-C in the terminal reaches the whole process group; children ignore the launcher's
        # SIGINT by running in their own session, and are stopped in order by stop().
        log = None
        if self.spec.log_dir:  # each service's output in its own file instead of this terminal
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
            log = open(Path(self.spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 (child owns it)
        self.procs[name] = subprocess.Popen(
            cmd, start_new_session=True, env={**os.environ, **self.security_env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT if log else None, preexec_fn=_die_with_parent,
        )  # fmt: skip
        if log is not None:
            log.close()  # the child has its own descriptor
        return ready_file

    def wait_ready(self, name: str, path: Path, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(name)
            if path.exists():
                self.ready[name] = dict(json.loads(path.read_text()))
                return self.ready[name]
            time.sleep(0.05)
        raise TimeoutError(f"{name} did not become ready within {timeout_s:.0f} s")

    def wait_http(self, name: str, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    # the gateway's own answer, not another server that took the port
                    if resp.status == 200 and b'"models"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not answer {url} within {timeout_s:.0f} s")

    def _check_alive(self, name: str) -> None:
        code = self.procs[name].poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with code {code} while starting")

    def _supervise(self) -> None:
        """Until stopped: notice dead children, start them again when due (``RestartPolicy``),
        and see the restarted ones become ready; raises when it gives up on the scheduler or
        the gateway (the system cannot serve without either)."""
        given_up: set[str] = set()
        while not self._stopping:
            now = time.monotonic()
            for name, p in list(self.procs.items()):
                child = self.children[name]
                if name in given_up:
                    continue
                if child.due is not None:
                    if now >= child.due:
                        self._restart(name, child)
                    continue
                code = p.poll()
                if code is None:
                    if child.starting is not None:
                        self._check_restarted(name, child, p, now)
                    continue
                child.starting = None
                window = self.spec.restart.window_s
                child.deaths = [t for t in child.deaths if now - t <= window] + [now]
                delay = self.spec.restart.delay(len(child.deaths))
                if delay is None:
                    given_up.add(name)
                    what = f"{name} exited with code {code}, {len(child.deaths)} times within " \
                           f"{window:.0f} s: not restarting it"  # fmt: skip
                    if name in ("scheduler", "gateway"):
                        raise RuntimeError(what)
                    self._log(what + "; the others keep serving")
                    continue
                child.due = now + delay
                self._log(f"{name} exited with code {code}; starting it again in {delay:.1f} s")
            time.sleep(0.1)

    def _restart(self, name: str, child: _Child) -> None:
        with self._lock:  # not once stop() has begun: it would leave this child running
            if self._stopping:
                return
            child.due = None
            self.spawn(name, child.argv, child.ready, child.env)
            self.children[name].starting = time.monotonic() + (
                SCHEDULER_START_S if name == "scheduler"
                else GATEWAY_START_S if name == "gateway" else WORKER_START_S
            )  # fmt: skip
            self.restarts[name] = self.restarts.get(name, 0) + 1

    def _check_restarted(self, name: str, child: _Child, p: subprocess.Popen, now: float) -> None:
        """A restarted child is back once it is ready (its ready file, or the gateway's /health);
        one that does not get there in time is killed (and counts as another death)."""
        path = self.tmp / f"{name}.json"
        if child.ready and path.exists():
            self.ready[name] = dict(json.loads(path.read_text()))
        elif not child.ready and self.url and _answers(self.url.removesuffix("/v1") + "/health"):
            pass
        else:
            if child.starting is not None and now > child.starting:
                self._log(f"{name} did not become ready again in time: killing it")
                p.kill()
            return
        child.starting = None
        self._log(f"{name} is serving again (restart {self.restarts.get(name, 0)})")

    @staticmethod
    def _log(line: str) -> None:
        print(f"baton serve: {line}", file=sys.stderr, flush=True)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
