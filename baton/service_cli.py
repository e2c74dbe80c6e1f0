"""The service sub-commands of ``baton``: ``worker``, ``global-scheduler``, ``gateway`` and
``serve`` (all of them on this machine). Each builds its frozen settings from the flags and
hands them to the service's ``serve``; nothing else reads the command line."""

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop  # the event loop of every service (gRPC p99 latency ~7× lower than asyncio's here)

from baton.engine_flags import ENGINE_HELP, add_engine_flags, engine_args, engine_flags_argv
from baton.launcher import Cluster, ClusterSpec, RestartPolicy  # (no grpc, no torch: see below)
from services.gateway.settings import EdgeLimits, InputLimits
from services.gateway.tool_parsers import PARSERS
from shared.affinity import check_cpus, parse_cpus
from shared.gguf_files import default_model_name
from shared.internal_auth import TLS_DIR_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Security, is_unspecified

if TYPE_CHECKING:
    from services.global_scheduler.settings import SchedulerSettings

# gRPC core's transport for every service: the poll-based I/O manager instead of EventEngine
# endpoints. With EventEngine a received message goes from an EventEngine thread to grpc.aio's
# poller thread, then to the event loop; with the older one the poller thread reads the socket
# itself: one thread wake-up fewer per message, each ~0.1 ms on an idle many-core host
# (docs/performance.md, "Where the time goes": gRPC's thread hops, a request's four messages
# 1.23 against 1.59 ms). gRPC reads this once, when its core starts, so it is set before any
# service imports grpc; an operator's own GRPC_EXPERIMENTS (even empty, for gRPC's defaults)
# wins, and so do tests that run services in their own process.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` of every ``baton`` command: each flag's default after its text, where it has
    one. A flag whose default means "not given" (None, off, empty) says in its text what
    happens then instead, since "(default: None)" tells a user nothing. A description's
    paragraphs are wrapped one by one; one with indented lines (examples) is kept as it is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(action.default, bool):
            # --x/--no-x: on or off, not True or False (Python 3.11 adds its own "(default: …)")
            text = text.replace(" (default: %(default)s)", "")
            return f"{text} (default: {'on' if action.default else 'off'})"
        if "%(default)" in text or not shows_default(action):
            return text
        return text + " (default: %(default)s)"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith(" ") for line in lines):  # an example: as it is written
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(super()._fill_text(para, width, indent))
        return "\n\n".join(paragraphs)


def shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` names ``action``'s default: that of a flag taking a value, or of a
    ``--x/--no-x`` pair, that is a value and not "not given" (a plain switch is off unless
    given)."""
    default = action.default
    if not action.option_strings or default is None or default is False:
        return False
    if default is argparse.SUPPRESS or (isinstance(default, str | tuple | list) and not default):
        return False
    return action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction)


LIMIT_FIELDS = [f.name for f in dataclasses.fields(InputLimits)]  # each a --max-… flag
PROGRESS_TIMEOUT_S = 10.0  # the gateway's progress bound (GatewaySettings.progress_timeout_s)
PREFILL_PROGRESS_MS_PER_TOKEN = 10.0


def input_limits(args: argparse.Namespace) -> InputLimits:
    return InputLimits(**{name: getattr(args, name) for name in LIMIT_FIELDS})


# EdgeLimits' fields as flags (docs/security.md, "Hostile clients"): field → (flag, type, help)
EDGE_FLAGS: dict[str, tuple[str, type, str]] = {
    "header_timeout_s": ("--header-timeout", float, "seconds a connection may take to send a "
                         "request's line and headers, from its accept (a later request on it: "
                         "from its first byte); past it the connection is closed"),
    "body_timeout_s": ("--body-timeout", float, "seconds a request's body may take to "
                       "arrive; past it a 408, and the connection is closed"),
    "max_connections": ("--max-connections", int, "client connections open at once; a "
                        "connection past it is answered 503 with Retry-After and closed "
                        "(lowered to fit the process's descriptor limit)"),
    "stream_write_timeout_s": ("--stream-write-timeout", float, "seconds a client may read "
                               "nothing of a response while its write buffer is full; past "
                               "it the response is dropped and its request aborted"),
}  # fmt: skip


def edge_limits(args: argparse.Namespace) -> EdgeLimits:
    return EdgeLimits(**{name: getattr(args, name) for name in EDGE_FLAGS})


def gateway_flags_argv(args: argparse.Namespace) -> list[str]:
    """The input-limit and edge flags off their defaults and the tool call parser, for a
    child ``baton gateway``."""
    default = InputLimits()
    argv = [item for name in LIMIT_FIELDS if getattr(args, name) != getattr(default, name)
            for item in ("--" + name.replace("_", "-"), str(getattr(args, name)))]  # fmt: skip
    if args.tool_call_parser is not None:
        argv += ["--tool-call-parser", args.tool_call_parser]
    edge = EdgeLimits()
    argv += [item for name, (flag, _, _) in EDGE_FLAGS.items()
             if getattr(args, name) != getattr(edge, name)
             for item in (flag, str(getattr(args, name)))]  # fmt: skip
    for flag, value, unset in (
        ("--progress-timeout", args.progress_timeout, PROGRESS_TIMEOUT_S),
        ("--prefill-progress-ms-per-token", args.prefill_progress_ms_per_token,
         PREFILL_PROGRESS_MS_PER_TOKEN),
    ):  # fmt: skip
        if value != unset:
            argv += [flag, str(value)]
    return argv


def run_worker(args: argparse.Namespace) -> None:
    from services.worker.main import serve
    from services.worker.settings import WorkerSettings
    from shared.logs import setup_logging

    setup_logging("worker")
    security = _configure_security(args, "worker")
    # the engine core (a child process) reads it for the KV side channel's handshakes
    os.environ[TOKEN_ENV] = security.token or ""
    # the KV side channel (and UCX) listen where peers are told to connect: never everywhere
    kv_host = args.advertise_host or args.host
    if is_unspecified(kv_host):
        raise SystemExit("baton worker: listening on all interfaces, it needs --advertise-host "
                         "(the address its KV side channel and UCX listen on)")  # fmt: skip
    engine = dataclasses.replace(engine_args(args), kv_side_channel_host=kv_host)
    try:
        settings = WorkerSettings(
            engine=engine, role=args.role, host=args.host, port=args.port,
            advertise_host=args.advertise_host,
            scheduler_addresses=tuple(a for a in (args.scheduler or '').split(',') if a),
            scheduler_resolve_interval_s=args.scheduler_resolve_interval,
            worker_id=args.worker_id or "", metrics_port=args.metrics_port,
            drain_timeout_s=args.drain_timeout, ready_file=args.ready_file, cpus=args.cpus,
            unregistered_exit_s=args.unregistered_exit_seconds, step_timeout_s=args.step_timeout,
        )  # fmt: skip
    except ValueError as e:  # a malformed --scheduler dns:NAME:PORT, say
        raise SystemExit(f"baton worker: {e}") from None
    sys.exit(uvloop.run(serve(settings)))


def run_scheduler(args: argparse.Namespace) -> None:
    from services.global_scheduler.main import serve
    from shared.logs import setup_logging

    setup_logging("scheduler")
    _configure_security(args, "global-scheduler")
    uvloop.run(serve(scheduler_settings(args)))


def scheduler_settings(args: argparse.Namespace) -> "SchedulerSettings":
    from services.global_scheduler.settings import SchedulerSettings, load_policy, redis_url

    try:
        redis = redis_url(args.redis_url, args.redis_url_file)
    except ValueError as e:
        raise SystemExit(f"baton global-scheduler: {e}") from None
    return SchedulerSettings(
        host=args.host, port=args.port, heartbeat_timeout_s=args.heartbeat_timeout,
        metrics_port=args.metrics_port, ready_file=args.ready_file,
        routing_policy=load_policy(args.routing_policy) if args.routing_policy else None,
        redis_url=redis, cpus=args.cpus, discovery=args.discovery,
        namespace=args.namespace, pod_selector=args.pod_selector,
        kubernetes_api=args.kubernetes_api, unregistered_after_s=args.unregistered_after,
        planner=load_policy(args.planner_config, "a planner config") if args.planner_config
        else None,
        scale_deployments=tuple(_pool_deployment(s) for s in args.scale_deployment or ()),
    )  # fmt: skip


def _pool_deployment(spec: str) -> tuple[str, str]:
    pool, eq, name = spec.partition("=")
    if not eq or pool not in ("prefill", "decode", "both") or not name:
        raise SystemExit(f"--scale-deployment {spec!r}: POOL=DEPLOYMENT, POOL prefill|decode|both")
    return pool, name


def _api_keys(args: argparse.Namespace, command: str = "gateway") -> tuple[str, ...]:
    """--api-key values, then the keys in --api-key-file (one per line; a Kubernetes Secret)."""
    keys = list(args.api_key or ())
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise SystemExit(f"baton {command}: --api-key-file: {e}") from None
        keys += [k.strip() for k in lines if k.strip() and not k.startswith("#")]
        if not keys:
            raise SystemExit(f"baton {command}: {args.api_key_file} holds no key")
    return tuple(keys)


def run_gateway(args: argparse.Namespace) -> None:
    from services.gateway.main import serve
    from services.gateway.settings import GatewaySettings
    from shared.logs import setup_logging

    setup_logging("gateway")
    _configure_security(args, "gateway")
    name = args.served_model_name or default_model_name(args.model)
    settings = GatewaySettings(
        scheduler_address=args.scheduler, models={name: args.model}, host=args.host,
        port=args.port, api_keys=_api_keys(args), max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout, generate_stream=not args.no_generate_stream,
        cpus=args.cpus, limits=input_limits(args), tool_call_parser=args.tool_call_parser,
        edge=edge_limits(args),
        metrics_port=args.metrics_port, progress_timeout_s=args.progress_timeout,
        prefill_progress_s_per_token=args.prefill_progress_ms_per_token / 1000,
    )  # fmt: skip
    serve(settings)


def _configure_security(args: argparse.Namespace, service: str) -> Security:
    """The internal token (required) and certificates (optional) for every gRPC channel and
    server of this process."""
    from shared import rpc

    try:
        security = Security.load(args.internal_token_file, args.internal_tls_dir)
    except (OSError, ValueError) as e:
        raise SystemExit(f"baton {service}: {e}") from None
    rpc.configure(security.require_token(service))
    return security


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--internal-token-file", default=None,
        help=f"a file holding the secret every internal call carries (default: "
        f"${TOKEN_FILE_ENV}, else ${TOKEN_ENV}; baton serve makes one when none is given)",
    )  # fmt: skip
    p.add_argument(
        "--internal-tls-dir", default=None,
        help="a directory with tls.crt, tls.key and ca.crt (a Kubernetes TLS Secret): TLS "
        f"with mutual authentication on every internal connection (default: ${TLS_DIR_ENV})",
    )  # fmt: skip


def _positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` above 0."""

    def parse(text: str) -> float:
        try:
            value: float = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _cpu_list(spec: str) -> tuple[int, ...]:
    """``--cpus``, checked as the flags are read: a CPU this process may not use fails before
    the service starts, with the CPUs it may use."""
    try:
        return check_cpus(parse_cpus(spec))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cpus_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpus",
        type=_cpu_list,
        default=(),
        help="pin this service's threads to these CPUs once it serves (e.g. 3 or 2,5-7); "
        "a worker's engine core keeps every CPU (default: no pinning)",
    )


def add_pin_cpus_flag(p: argparse.ArgumentParser) -> None:
    """``baton serve --pin-cpus [CPUS]`` (and the benchmarks that start a cluster)."""
    p.add_argument(
        "--pin-cpus",
        nargs="?",
        const="auto",
        default=None,
        metavar="CPUS",
        help="give the scheduler, each worker's front and the gateway a CPU of its own: the "
        "highest-numbered ones, leaving one or more to the engine cores; or CPUS dealt out in "
        "order (e.g. 8-15). Lower added latency on an idle many-core machine (default: no "
        "pinning)",
    )


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """``baton serve``'s flags as the launcher's frozen spec."""
    _api_keys(args, "serve")  # a missing or empty --api-key-file fails before anything starts
    return ClusterSpec(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, api_keys=tuple(args.api_key or ()), max_body_bytes=args.max_body_bytes,
        api_key_file=args.api_key_file,
        request_timeout=args.request_timeout, generate_stream=not args.no_generate_stream,
        workers=args.workers, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, worker_metrics=args.worker_metrics,
        drain_timeout_s=args.drain_timeout, step_timeout_s=args.step_timeout,
        log_dir=args.log_dir, redis_url=args.redis_url, routing_policy=args.routing_policy,
        gpus=args.gpus, pin_cpus=args.pin_cpus, device=args.device,
        kv_sized=bool(args.num_kv_blocks or args.kv_cache_memory_bytes),
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        engine_argv=tuple(engine_flags_argv(args)), gateway_argv=tuple(gateway_flags_argv(args)),
        internal_token_file=args.internal_token_file, internal_tls_dir=args.internal_tls_dir,
        restart=RestartPolicy(max_restarts=args.max_restarts, delay_s=args.restart_delay,
                              max_delay_s=max(args.restart_delay, RestartPolicy.max_delay_s)),
    )  # fmt: skip


def run_serve(args: argparse.Namespace) -> None:
    Cluster(cluster_spec(args)).run()


MODEL_HELP = (
    "the model: a Hugging Face checkpoint directory (safetensors), or a GGUF file (or "
    "a directory holding one)"
)
METRICS_PORT_HELP = "serve Prometheus /metrics on this port (0: any free port; default: none)"
READY_FILE_HELP = ("write the address and ports it serves on to this JSON file once it serves, "
                   "for a launcher to wait on")  # fmt: skip
REDIS_URL_HELP = ("redis://HOST:PORT/DB: keep the prefix directory in Redis, shared by "
                  "scheduler replicas (default: in the scheduler's memory)")  # fmt: skip
ROUTING_POLICY_HELP = ("a YAML or JSON routing policy: filters, weighted scorers, the P/D "
                       "decider (docs/routing.md; default: the built-in policy)")  # fmt: skip
LIMIT_HELP = {
    "max_prompts": "the most prompts in one completions request (a batch)",
    "max_stop": "the most stop strings in one request",
    "max_stop_chars": "the most characters in one stop string",
    "max_stop_token_ids": "the most stop_token_ids in one request",
    "max_messages": "the most messages in one chat request",
    "max_bad_words": "the most bad_words in one request",
    "max_bad_word_chars": "the most characters in one bad word",
    "max_allowed_token_ids": "the most allowed_token_ids in one request",
    "max_logit_bias": "the most logit_bias entries in one request",
    "max_grammar_chars": "the most characters of one request's grammar (a JSON schema as "
    "JSON text, a regex, an EBNF grammar, a choice's strings), and of its tools' parameter "
    "schemas",
    "max_tools": "the most tools in one chat request",
}


def _command(
    sub: argparse._SubParsersAction, name: str, summary: str, details: str = ""
) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` shows each flag's default (``HelpFormatter``)."""
    description = summary[0].upper() + summary[1:] + "." + (f"\n\n{details}" if details else "")
    return sub.add_parser(name, help=summary, description=description,
                          formatter_class=HelpFormatter)  # fmt: skip


def add_service_commands(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "worker", "serve one engine over gRPC (registers with the scheduler)")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="prefill: only prefills, its KV caches pulled by decode workers; "
                   "decode: decodes, pulling long prompts' KV caches; both: "
                   "everything")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="the address its gRPC server listens on")
    p.add_argument("--port", type=int, default=0, help="its gRPC port (0: any free port)")
    p.add_argument("--advertise-host", default=None,
                   help="the address the scheduler and peers reach it at, where its KV side "
                   "channel and UCX listen too (default: --host; required when --host is "
                   "every interface)")  # fmt: skip
    p.add_argument(
        "--scheduler",
        default=None,
        help="host:port of the global scheduler (comma-separated: one per replica), or "
        "dns:NAME:PORT: every address NAME resolves to (A/AAAA; a Kubernetes headless "
        "Service), looked up again every --scheduler-resolve-interval seconds, a replica "
        "joining or leaving followed without a restart",
    )
    p.add_argument("--scheduler-resolve-interval", type=float, default=5.0,
                   help="with --scheduler dns:NAME:PORT, seconds between lookups")  # fmt: skip
    p.add_argument("--worker-id", default=None,
                   help="its name in the scheduler's registry (default: HOSTNAME-PID)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, help=METRICS_PORT_HELP)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds its running requests may take to finish")  # fmt: skip
    p.add_argument(
        "--unregistered-exit-seconds", type=float, default=300.0,
        help="stop (exit code 1, for the supervisor to restart the worker) after this many "
        "seconds registered with no global scheduler replica; 0: never",
    )  # fmt: skip
    p.add_argument(
        "--step-timeout", type=float, default=60.0,
        help="seconds its engine may have work and make no progress (no step ends: the engine "
        "core stopped, its GPU wedged, a collective stuck); past it the worker is hung: /health "
        "fails, it leaves the schedulers (its streams resume elsewhere) and exits with code 1 "
        "soon after; longer than any step and than a KV pull's bound (35 s); 0: never",
    )  # fmt: skip
    p.add_argument("--ready-file", default=None, help=READY_FILE_HELP)
    p.add_argument("--kv-transfer", action="store_true",
                   help="send and receive KV caches over NIXL (on with --role prefill or "
                   "decode)")  # fmt: skip
    _add_cpus_flag(p)
    _add_security_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run_worker)

    p = _command(sub, "global-scheduler", "the worker registry, the prefix directory and "
                 "routing: which worker serves each request")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="the address its gRPC server listens on")
    p.add_argument("--port", type=int, default=50051, help="its gRPC port (0: any free port)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.5,
                   help="seconds without a heartbeat after which a worker is dropped")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, help=METRICS_PORT_HELP)
    p.add_argument("--routing-policy", default=None, help=ROUTING_POLICY_HELP)
    redis = p.add_mutually_exclusive_group()
    redis.add_argument("--redis-url", default=None,
                       help="redis://[USER:PASSWORD@]HOST:PORT/DB: keep the prefix directory in "
                       "Redis, shared by scheduler replicas; it shows in the process list, "
                       "--redis-url-file does not (default: $BATON_REDIS_URL, else in the "
                       "scheduler's memory)")  # fmt: skip
    redis.add_argument("--redis-url-file", default=None, metavar="FILE",
                       help="a file holding the Redis URL (a Kubernetes Secret, say), instead "
                       "of --redis-url")  # fmt: skip
    p.add_argument("--ready-file", default=None, help=READY_FILE_HELP)
    p.add_argument("--discovery", default="none", choices=["none", "kubernetes"],
                   help="watch the worker pods through the Kubernetes API")  # fmt: skip
    p.add_argument("--namespace", default="", help="the pods' namespace (default: this pod's)")
    p.add_argument("--pod-selector", default="",
                   help="the worker pods' labels, k=v,k2=v2 (required with --discovery "
                   "kubernetes)")  # fmt: skip
    p.add_argument("--kubernetes-api", default=None, help=argparse.SUPPRESS)  # tests
    p.add_argument("--unregistered-after", type=float, default=120.0,
                   help="with --discovery kubernetes: report a pod that has been Ready this "
                   "many seconds without registering")  # fmt: skip
    p.add_argument("--planner-config", default=None,
                   help="a YAML or JSON planner config: turns the planner on, which publishes "
                   "each pool's desired replicas (docs/deploy.md, \"The planner\"; default: "
                   "off)")  # fmt: skip
    p.add_argument("--scale-deployment", action="append", metavar="POOL=DEPLOYMENT",
                   help="the planner sets this Deployment's replicas; POOL is prefill, decode "
                   "or both (repeatable; default: it only publishes them)")  # fmt: skip
    _add_cpus_flag(p)
    _add_security_flags(p)
    p.set_defaults(func=run_scheduler)

    p = _command(sub, "gateway", "the OpenAI-compatible HTTP API")
    _gateway_flags(p)
    p.add_argument("--scheduler", required=True, help="host:port of the global scheduler")
    p.add_argument("--served-model-name", default=None, help=ENGINE_HELP["served_model_name"])
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /health, /ready and Prometheus /metrics on this port too, "
                   "without a key (for probes and scrapers; 0: any free port), and take "
                   "/metrics off the API port (default: /metrics on the API port, behind "
                   "the API keys when there are some)")  # fmt: skip
    _add_cpus_flag(p)
    _add_security_flags(p)
    p.set_defaults(func=run_gateway)

    p = _command(sub, "serve", "the whole system on this machine: the global scheduler, the "
                 "workers and the OpenAI gateway, restarting a service that dies",
                 "It prints 'Baton is serving NAME at http://HOST:PORT/v1' once the API "
                 "answers (GET /ready is 200 from then on); Ctrl-C stops it.\n\nexample:\n"
                 "  baton serve --model path/to/checkpoint --port 8000")  # fmt: skip
    _gateway_flags(p)
    p.add_argument("--workers", type=int, default=None,
                   help="colocated workers, each prefilling and decoding (default: 1, or 0 "
                   "with --prefill-workers or --decode-workers)")  # fmt: skip
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="workers that only prefill long prompts, their KV caches pulled by "
                   "the decode workers over NIXL")  # fmt: skip
    p.add_argument("--decode-workers", type=int, default=0,
                   help="workers that decode (and prefill short prompts)")  # fmt: skip
    p.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="the prefill pool's TP size (default: --tensor-parallel-size)",
    )
    p.add_argument(
        "--decode-tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="the decode pool's TP size (default: --tensor-parallel-size)",
    )
    p.add_argument("--worker-metrics", action="store_true",
                   help="give each worker a Prometheus /metrics port")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on stop, seconds a worker's running requests may take to "
                   "finish")  # fmt: skip
    p.add_argument("--step-timeout", type=float, default=60.0,
                   help="seconds a worker's engine may have work and make no progress before "
                   "the worker counts as hung: it leaves the schedulers (its streams resume "
                   "elsewhere) and exits, and is started again; 0: never")  # fmt: skip
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write each service's log to DIR/<name>.log (default: this "
                   "terminal)")  # fmt: skip
    p.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    p.add_argument("--routing-policy", default=None, help=ROUTING_POLICY_HELP)
    p.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU ids; worker i gets GPU i mod their number "
        "(default: CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=RestartPolicy.max_restarts,
        help="restart a service that dies, up to N times within 5 minutes (0: never); past "
        "that a worker stays down and the scheduler or the gateway stops the whole system",
    )  # fmt: skip
    p.add_argument(
        "--restart-delay", type=float, default=RestartPolicy.delay_s,
        help="seconds before the first restart of a service; doubled with each further "
        "death, up to 8 s",
    )  # fmt: skip
    add_pin_cpus_flag(p)
    _add_security_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run_serve)


def _gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the OpenAI API listens on (0.0.0.0: every "
                   "interface)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="the OpenAI API's port")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY) on /v1/*; "
                   "repeatable; it shows in the process list, --api-key-file does not "
                   "(default: no authentication)")  # fmt: skip
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one a line ('#' starts a comment), added to --api-key: "
                   "a Kubernetes Secret, say")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="the largest request body, in bytes (413 above it)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take in all before it fails with a 504")  # fmt: skip
    p.add_argument("--progress-timeout", type=float, default=PROGRESS_TIMEOUT_S,
                   help="seconds a worker may send a stream no token before it counts as "
                   "failed and the stream resumes on another worker (the default is twenty "
                   "times the longest engine step, a chunked prefill's)")  # fmt: skip
    p.add_argument("--prefill-progress-ms-per-token", type=float,
                   default=PREFILL_PROGRESS_MS_PER_TOKEN,
                   help="milliseconds the wait for a stream's first token (and for a prefill "
                   "leg's answer) adds per prompt token the worker must compute (10: a floor "
                   "of 100 prefill tokens/s, a large model on CPU)")  # fmt: skip
    edge = EdgeLimits()
    for name, (flag, kind, text) in EDGE_FLAGS.items():
        p.add_argument(flag, dest=name, type=_positive(kind), default=getattr(edge, name),
                       metavar="N" if kind is int else "SECONDS", help=text)  # fmt: skip
    defaults = InputLimits()
    for name in LIMIT_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                       help=LIMIT_HELP.get(name, "an input limit per request") + "; a request "
                       "above it gets a 400")  # fmt: skip
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="read tool calls out of replies to chat requests with tools and "
                   "tool_choice 'auto' (the default with tools): hermes (Hermes, Qwen: "
                   "<tool_call>{...}</tool_call>) or llama3_json (Llama 3.1's JSON); without "
                   "it such a request gets a 400 ('required' and a named function need "
                   "none)")  # fmt: skip
    p.add_argument(
        "--no-generate-stream",
        action="store_true",
        help="call workers with one unary Generate per request, not over a long-lived stream",
    )
