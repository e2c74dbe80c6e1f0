"""The service sub-commands of ``baton``: ``worker``, ``global-scheduler``, ``gateway`` and
``serve`` (all of them on this machine). Each builds its frozen settings from the flags and
hands them to the service's ``serve``; nothing else reads the command line."""

import argparse
import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import uvloop  # the event loop of every service (gRPC p99 latency ~7× lower than asyncio's here)

from baton.launcher import Cluster, ClusterSpec, RestartPolicy  # (no grpc, no torch: see below)
from services.gateway.settings import InputLimits
from services.worker.engine.config import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    EngineArgs,
)
from shared.affinity import check_cpus, parse_cpus
from shared.internal_auth import TLS_DIR_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Security, is_unspecified

# gRPC core's transport for every service: the poll-based I/O manager instead of EventEngine
# endpoints. With EventEngine a received message goes from an EventEngine thread to grpc.aio's
# poller thread, then to the event loop; with the older one the poller thread reads the socket
# itself: one thread wake-up fewer per message, each ~0.1 ms on an idle many-core host
# (docs/results/h200-2026-11-30d/NOTES.md, "gRPC's thread hops"). gRPC reads this once, when
# its core starts, so it is set before any service imports grpc; an operator's own
# GRPC_EXPERIMENTS (even empty, for gRPC's defaults) wins, and so do tests that run services
# in their own process.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)

# EngineArgs fields that are flags of ``baton worker`` and ``baton serve`` (``--field-name``).
# Type, default and choices come from EngineArgs itself; a bool that defaults to True becomes
# ``--no-<name>`` (without its ``enable_``), one that defaults to None ``--<name>/--no-<name>``.
ENGINE_FLAGS = (
    "served_model_name", "dtype", "load_format", "seed", "max_model_len", "block_size",
    "num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs",
    "max_num_batched_tokens", "attention_backend", "device", "enable_prefix_caching",
    "enforce_eager", "async_scheduling", "kv_lease_seconds", "kv_recompute_on_failure",
    "tensor_parallel_size", "distributed_executor_backend", "quantization", "kv_cache_dtype",
    "fp8_fast_accumulation", "piecewise_cuda_graph_tokens",
)  # fmt: skip
ENGINE_HELP = {
    "enforce_eager": "no CUDA graphs",
    "async_scheduling": "schedule the next step while the device runs this one (default: on "
    "for CUDA)",
    "kv_lease_seconds": "prefill side: how long a prompt's KV waits to be pulled",
    "kv_recompute_on_failure": "decode side: a failed KV pull fails its request with a 502 "
    "instead of recomputing the prompt locally (the default)",
    "kv_cache_dtype": "fp8: the KV cache in e4m3, one byte an element, with a scale per layer",
    "fp8_fast_accumulation": "FP8 models: batched products accumulate in the tensor cores' own "
    "precision instead of float32 (default: on; faster, less exact over long rows)",
    "piecewise_cuda_graph_tokens": "steps of up to N tokens that the decode graphs do not "
    "take (prefill, mixed) replay CUDA graphs split at each attention call (0: eager; "
    "default: 8192 on one GPU, 0 at tensor_parallel_size > 1)",
    "quantization": "fp8: quantize a float checkpoint's linear layers to FP8 at load (an FP8 "
    "checkpoint is read as it is, without this flag)",
    "tensor_parallel_size": "split the model over N ranks (GPUs), one process each "
    "(baton serve gives each worker N GPUs)",
    "distributed_executor_backend": "how the ranks run: uni (in the engine core, tp=1), mp (a "
    "process per rank, the default at tp>1) or ray (a Ray actor per rank; RAY_ADDRESS names "
    "the cluster)",
}
_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _flag(name: str) -> str:
    field = _FIELDS[name]
    if field.type is bool and field.default is True:
        return "--no-" + name.removeprefix("enable_").replace("_", "-")
    return "--" + name.replace("_", "-")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    for name in ENGINE_FLAGS:
        field, flag = _FIELDS[name], _flag(name)
        kw: dict[str, Any] = {"dest": name, "default": field.default, "help": ENGINE_HELP.get(name)}
        if field.type is bool:
            kw["action"] = "store_false" if field.default else "store_true"
        elif typing.get_args(field.type) == (bool, type(None)):
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(field.type) is typing.Literal:
            kw["choices"] = typing.get_args(field.type)
        else:  # str, int, float, or one of them | None
            kw["type"] = next(t for t in (*typing.get_args(field.type), field.type)
                              if t in (str, int, float))  # fmt: skip
        if name == "load_format":
            kw["choices"] = LOAD_FORMATS
        if name == "distributed_executor_backend":
            kw["choices"] = EXECUTOR_BACKENDS
        if name == "quantization":
            kw["choices"] = ("fp8",)
        if name == "kv_cache_dtype":
            kw["choices"] = KV_CACHE_DTYPES
        p.add_argument(flag, **kw)


LIMIT_FIELDS = [f.name for f in dataclasses.fields(InputLimits)]  # each a --max-… flag


def input_limits(args: argparse.Namespace) -> InputLimits:
    return InputLimits(**{name: getattr(args, name) for name in LIMIT_FIELDS})


def limit_flags_argv(args: argparse.Namespace) -> list[str]:
    """The input-limit flags off their defaults, for a child ``baton gateway``."""
    default = InputLimits()
    return [item for name in LIMIT_FIELDS if getattr(args, name) != getattr(default, name)
            for item in ("--" + name.replace("_", "-"), str(getattr(args, name)))]  # fmt: skip


def engine_args(args: argparse.Namespace) -> EngineArgs:
    role = getattr(args, "role", "both")
    return EngineArgs(
        model=args.model,
        kv_transfer=role in ("prefill", "decode") or getattr(args, "kv_transfer", False),
        **{name: getattr(args, name) for name in ENGINE_FLAGS},
    )


def engine_flags_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags as given (those off their default), to pass on to ``baton worker``."""
    argv = []
    for name in ENGINE_FLAGS:
        value, default, flag = getattr(args, name), _FIELDS[name].default, _flag(name)
        if value == default:
            continue
        if isinstance(value, bool) and isinstance(default, bool):
            argv.append(flag)
        elif isinstance(value, bool):  # --x / --no-x
            argv.append(flag if value else "--no-" + flag[2:])
        else:
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
    settings = WorkerSettings(
        engine=engine, role=args.role, host=args.host, port=args.port,
        advertise_host=args.advertise_host,
        scheduler_addresses=tuple(a for a in (args.scheduler or '').split(',') if a),
        worker_id=args.worker_id or "", metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout, ready_file=args.ready_file, cpus=args.cpus,
    )  # fmt: skip
    uvloop.run(serve(settings))


def run_scheduler(args: argparse.Namespace) -> None:
    from services.global_scheduler.main import serve
    from services.global_scheduler.settings import SchedulerSettings, load_policy
    from shared.logs import setup_logging

    setup_logging("scheduler")
    _configure_security(args, "global-scheduler")
    settings = SchedulerSettings(
        host=args.host, port=args.port, heartbeat_timeout_s=args.heartbeat_timeout,
        metrics_port=args.metrics_port, ready_file=args.ready_file,
        routing_policy=load_policy(args.routing_policy) if args.routing_policy else None,
        redis_url=args.redis_url, cpus=args.cpus, discovery=args.discovery,
        namespace=args.namespace, pod_selector=args.pod_selector,
        kubernetes_api=args.kubernetes_api, unregistered_after_s=args.unregistered_after,
        planner=load_policy(args.planner_config, "a planner config") if args.planner_config
        else None,
        scale_deployments=tuple(_pool_deployment(s) for s in args.scale_deployment or ()),
    )  # fmt: skip
    uvloop.run(serve(settings))


def _pool_deployment(spec: str) -> tuple[str, str]:
    pool, eq, name = spec.partition("=")
    if not eq or pool not in ("prefill", "decode", "both") or not name:
        raise SystemExit(f"--scale-deployment {spec!r}: POOL=DEPLOYMENT, POOL prefill|decode|both")
    return pool, name


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key values, then the keys in --api-key-file (one per line; a Kubernetes Secret)."""
    keys = list(args.api_key or ())
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise SystemExit(f"baton gateway: --api-key-file: {e}") from None
        keys += [k.strip() for k in lines if k.strip() and not k.startswith("#")]
        if not keys:
            raise SystemExit(f"baton gateway: {args.api_key_file} holds no key")
    return tuple(keys)


def run_gateway(args: argparse.Namespace) -> None:
    from services.gateway.main import serve
    from services.gateway.settings import GatewaySettings
    from shared.logs import setup_logging

    setup_logging("gateway")
    _configure_security(args, "gateway")
    name = args.served_model_name or Path(args.model).name
    settings = GatewaySettings(
        scheduler_address=args.scheduler, models={name: args.model}, host=args.host,
        port=args.port, api_keys=_api_keys(args), max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout, generate_stream=not args.no_generate_stream,
        cpus=args.cpus, limits=input_limits(args),
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
        "a worker's engine core keeps every CPU",
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
        "order (e.g. 8-15). Lower added latency on an idle many-core machine",
    )


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """``baton serve``'s flags as the launcher's frozen spec."""
    return ClusterSpec(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, api_keys=tuple(args.api_key or ()), max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout, generate_stream=not args.no_generate_stream,
        workers=args.workers, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, worker_metrics=args.worker_metrics,
        drain_timeout_s=args.drain_timeout,
        log_dir=args.log_dir, redis_url=args.redis_url, routing_policy=args.routing_policy,
        gpus=args.gpus, pin_cpus=args.pin_cpus, device=args.device,
        kv_sized=bool(args.num_kv_blocks or args.kv_cache_memory_bytes),
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        engine_argv=tuple(engine_flags_argv(args)), gateway_argv=tuple(limit_flags_argv(args)),
        internal_token_file=args.internal_token_file, internal_tls_dir=args.internal_tls_dir,
        restart=RestartPolicy(max_restarts=args.max_restarts, delay_s=args.restart_delay,
                              max_delay_s=max(args.restart_delay, RestartPolicy.max_delay_s)),
    )  # fmt: skip


def run_serve(args: argparse.Namespace) -> None:
    Cluster(cluster_spec(args)).run()


def add_service_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve one engine over gRPC (registers with the scheduler)")
    p.add_argument("--model", required=True)
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--advertise-host", default=None)
    p.add_argument(
        "--scheduler",
        default=None,
        help="host:port of the global scheduler (comma-separated: one per replica)",
    )
    p.add_argument("--worker-id", default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--ready-file", default=None)
    p.add_argument(
        "--kv-transfer", action="store_true", help="NIXL KV transfer (on for prefill/decode)"
    )
    _add_cpus_flag(p)
    _add_security_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run_worker)

    p = sub.add_parser("global-scheduler", help="worker registry, prefix directory, routing")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--heartbeat-timeout", type=float, default=1.5)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--routing-policy", default=None, help="YAML/JSON file (see routing.py)")
    p.add_argument("--redis-url", default=None, help="share the prefix directory in Redis")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--discovery", default="none", choices=["none", "kubernetes"],
                   help="watch the worker pods through the Kubernetes API")  # fmt: skip
    p.add_argument("--namespace", default="", help="the pods' namespace (default: this pod's)")
    p.add_argument("--pod-selector", default="", help="the worker pods' labels: k=v,k2=v2")
    p.add_argument("--kubernetes-api", default=None, help=argparse.SUPPRESS)  # tests
    p.add_argument("--unregistered-after", type=float, default=120.0,
                   help="report a pod Ready this long that never registered")  # fmt: skip
    p.add_argument("--planner-config", default=None,
                   help="YAML/JSON file: turn the planner on (see planner.py)")  # fmt: skip
    p.add_argument("--scale-deployment", action="append", metavar="POOL=DEPLOYMENT",
                   help="the planner sets this Deployment's replicas (repeatable)")  # fmt: skip
    _add_cpus_flag(p)
    _add_security_flags(p)
    p.set_defaults(func=run_scheduler)

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP API")
    _gateway_flags(p)
    p.add_argument("--scheduler", required=True, help="host:port of the global scheduler")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key-file", default=None,
                   help="API keys, one per line (added to --api-key)")  # fmt: skip
    _add_cpus_flag(p)
    _add_security_flags(p)
    p.set_defaults(func=run_gateway)

    p = sub.add_parser("serve", help="scheduler + workers + gateway on this machine")
    _gateway_flags(p)
    p.add_argument("--workers", type=int, default=None, help="colocated workers (role both)")
    p.add_argument("--prefill-workers", type=int, default=0)
    p.add_argument("--decode-workers", type=int, default=0)
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
    p.add_argument("--worker-metrics", action="store_true", help="give each worker /metrics")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="a worker's SIGTERM: how long its requests may finish")  # fmt: skip
    p.add_argument("--log-dir", default=None, help="write each service's log to DIR/<name>.log")
    p.add_argument("--redis-url", default=None, help="prefix directory in Redis (default: memory)")
    p.add_argument("--routing-policy", default=None, help="YAML/JSON file (see routing.py)")
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
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", help="repeatable; none: no authentication")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--request-timeout", type=float, default=600.0)
    defaults = InputLimits()
    for name in LIMIT_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                       help="an input limit per request (400 above it)")  # fmt: skip
    p.add_argument(
        "--no-generate-stream",
        action="store_true",
        help="call workers with one unary Generate per request, not over a long-lived stream",
    )
