"""``baton serve``: the whole system as processes on this machine.

    global scheduler ──ready file──▶ N workers ──ready files──▶ gateway ──/ready──▶ print URL

The launcher takes a frozen ``ClusterSpec`` (``baton/service_cli.py`` builds one from the
flags; ``baton/serving.py`` runs one for tests and benchmarks) and imports nothing of the
command line. Each child is a plain ``baton <service>`` process (what a Kubernetes pod runs).
Every wait is bounded and notices a child that exits. Ctrl-C (or SIGTERM) stops the gateway
first, then the workers (they drain), then the scheduler; anything still alive after the bound
is killed. A worker that dies while serving is reported and the others keep serving; the
scheduler or the gateway dying stops everything.
"""

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.affinity import assign_cpus
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
class ClusterSpec:
    """What ``baton serve`` starts: the flags of ``baton serve``, parsed once."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"  # the gateway's
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout: float = 600.0
    generate_stream: bool = True  # False: one unary Generate per request
    workers: int | None = None  # colocated (role both); None: 1 unless a P/D pool is asked for
    prefill_workers: int = 0
    decode_workers: int = 0
    worker_metrics: bool = False  # give each worker /metrics
    log_dir: str | None = None  # each service's output to DIR/<name>.log
    redis_url: str | None = None
    routing_policy: str | None = None  # a YAML/JSON file
    gpus: str | None = None  # comma-separated ids; None: CUDA_VISIBLE_DEVICES, else nvidia-smi
    pin_cpus: str | None = None  # "auto" or a CPU list (shared/affinity.assign_cpus)
    device: str = "auto"
    kv_sized: bool = False  # the engine flags give the KV cache an explicit size
    engine_argv: tuple[str, ...] = ()  # the engine flags every worker gets, as argv
    gateway_argv: tuple[str, ...] = ()  # flags the gateway gets besides those above (limits)


class Cluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.engine_argv = list(spec.engine_argv)
        self.tmp = make_private_dir("baton-serve-")  # removed by stop(); stale ones at start
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, dict] = {}  # name → what it wrote when ready (address, ports)
        self._stopping = False
        self.url: str | None = None  # the OpenAI base URL, once started

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
        return self.spec.served_model_name or Path(self.spec.model).name

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
        sched_addr = self.wait_ready("scheduler", sched, SCHEDULER_START_S)["address"]
        workers = []
        gpus = self.gpus()
        if gpus and len(roles) > len(gpus) and not a.kv_sized:
            print(f"baton serve: {len(roles)} workers share {len(gpus)} GPU(s), and each sizes "
                  "its KV cache from the memory it finds free: give each a size "
                  "(--kv-cache-memory-bytes or --num-kv-blocks)", file=sys.stderr)  # fmt: skip
        for i, (name, role) in enumerate(roles):
            argv = ["worker", "--model", a.model, "--scheduler", sched_addr, "--worker-id", name,
                    "--role", role]  # fmt: skip
            if a.worker_metrics:
                argv += ["--metrics-port", "0"]
            argv += cpus[name]
            env = {"OMP_NUM_THREADS": str(self._threads_per_worker())}
            if gpus:  # one GPU each, round robin: P/D pools land on different GPUs
                env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            workers.append((name, self.spawn(name, argv + self.engine_argv, True, env)))
        for name, path in workers:
            self.wait_ready(name, path, WORKER_START_S)
        argv = ["gateway", "--model", a.model, "--scheduler", sched_addr, "--host", a.host,
                "--port", str(a.port), "--served-model-name", self.model_name,
                "--max-body-bytes", str(a.max_body_bytes),
                "--request-timeout", str(a.request_timeout)]  # fmt: skip
        for key in a.api_keys:
            argv += ["--api-key", key]
        argv += [] if a.generate_stream else ["--no-generate-stream"]
        argv += a.gateway_argv
        self.spawn("gateway", argv + cpus["gateway"], ready=False)
        url = f"http://{a.host}:{a.port}"
        self.wait_http("gateway", f"{url}/ready", GATEWAY_START_S)
        self.url = f"{url}/v1"
        return self.url

    def stop(self) -> None:
        """Stop the children in order: gateway, workers, scheduler (each bounded)."""
        self._stopping = True
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
        return max(1, (os.cpu_count() or 1) // max(1, len(self.worker_roles())))

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
            cmd, start_new_session=True, env={**os.environ, **(env or {})}, stdout=log,
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
        reported: set[str] = set()
        while not self._stopping:
            for name, p in self.procs.items():
                code = p.poll()
                if code is None or name in reported:
                    continue
                if name in ("scheduler", "gateway"):
                    raise RuntimeError(f"{name} exited with code {code}")
                print(f"baton serve: {name} exited with code {code}; the others keep serving",
                      file=sys.stderr, flush=True)  # fmt: skip
                reported.add(name)
            time.sleep(0.2)
