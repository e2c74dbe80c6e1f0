"""``baton serve``'s launcher, without starting anything: worker roles, GPU placement and the
engine flags it hands on."""

import pytest

from baton.cli import build_parser
from baton.launcher import Cluster
from baton.service_cli import cluster_spec


def cluster(*argv: str) -> Cluster:
    return Cluster(cluster_spec(build_parser().parse_args(["serve", "--model", "m", *argv])))


def test_worker_roles() -> None:
    assert cluster().worker_roles() == [("worker-0", "both")]
    assert cluster("--prefill-workers", "2", "--decode-workers", "1").worker_roles() == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="decode-capable"):
        cluster("--prefill-workers", "1").worker_roles()


def test_gpus_from_the_flag_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert cluster("--gpus", "0,1").gpus() == ["0", "1"]
    assert cluster().gpus() == ["3", "5"]
    assert cluster("--device", "cpu").gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose: none
    assert cluster().gpus() == []


def test_each_worker_gets_its_tensor_parallel_gpus() -> None:
    from baton.launcher import worker_gpus

    gpus = ["0", "1", "2", "3"]
    assert [worker_gpus(gpus, first, 2) for first in (0, 2)] == [["0", "1"], ["2", "3"]]
    assert [worker_gpus(gpus, i, 1) for i in range(5)] == [["0"], ["1"], ["2"], ["3"], ["0"]]
    assert worker_gpus(gpus, 4, 2) == ["0", "1"]  # more ranks than GPUs: they share, in turn
    c = cluster("--tensor-parallel-size", "2", "--prefill-workers", "1", "--decode-workers", "1",
                "--decode-tensor-parallel-size", "4")  # fmt: skip
    assert [c.worker_tp(role) for _, role in c.worker_roles()] == [2, 4]
    assert cluster("--tensor-parallel-size", "2").worker_tp("both") == 2


def test_tensor_parallel_flags_reach_the_workers() -> None:
    from baton.service_cli import engine_args, engine_flags_argv

    serve = build_parser().parse_args(["serve", "--model", "m", "--tensor-parallel-size", "2",
                                       "--distributed-executor-backend", "ray"])  # fmt: skip
    args = engine_args(build_parser().parse_args(["worker", "--model", "m",
                                                  *engine_flags_argv(serve)]))  # fmt: skip
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "ray")


def test_gpus_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cluster().gpus() == []


@pytest.mark.parametrize("name", ["async_scheduling", "fp8_fast_accumulation"])
@pytest.mark.parametrize(("given", "expected"), [("", None), ("--", True), ("--no-", False)])
def test_tristate_flags_reach_the_workers(name: str, given: str, expected: bool | None) -> None:
    """``baton serve`` passes the flag on to every worker, whose engine args carry it (None:
    the engine decides: the device for async scheduling, the model for FP8 accumulation)."""
    from baton.service_cli import engine_args, engine_flags_argv

    flags = [given + name.replace("_", "-")] if given else []
    serve = build_parser().parse_args(["serve", "--model", "m", *flags])
    worker_argv = ["worker", "--model", "m", *engine_flags_argv(serve)]
    assert getattr(engine_args(build_parser().parse_args(worker_argv)), name) is expected


@pytest.mark.parametrize(("flags", "expected"), [([], None), (["0"], 0), (["2048"], 2048)])
def test_piecewise_graph_tokens_reach_the_workers(flags: list[str], expected: int | None) -> None:
    """Absent, the workers' engines decide (on at one GPU); 0 (off) is passed on, not taken
    for the default."""
    from baton.service_cli import engine_args, engine_flags_argv

    given = ["--piecewise-cuda-graph-tokens", *flags] if flags else []
    serve = build_parser().parse_args(["serve", "--model", "m", *given])
    worker_argv = ["worker", "--model", "m", *engine_flags_argv(serve)]
    assert engine_args(build_parser().parse_args(worker_argv)).piecewise_cuda_graph_tokens == (
        expected
    )


_PROBE = (
    "import os, sys; from baton.cli import build_parser; build_parser(); "
    "print('grpc' in sys.modules, repr(os.environ.get('GRPC_EXPERIMENTS')))"
)


@pytest.mark.parametrize(
    ("given", "expected"),
    [(None, "'-event_engine_client,-event_engine_listener'"), ("", "''"), ("x", "'x'")],
)
def test_grpc_core_setting_comes_before_grpc_and_yields_to_the_operator(
    given: str | None, expected: str
) -> None:
    """gRPC core reads GRPC_EXPERIMENTS once, when it starts: every service command must set
    its default before anything imports grpc, and keep an operator's own value (an empty one
    restores gRPC's defaults). ``baton serve`` hands its environment to every process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", expected]


def test_grpc_core_knows_the_experiments_the_services_turn_off() -> None:
    """gRPC core names an experiment it does not know on stderr and goes on with its defaults:
    a grpcio upgrade that drops these would silently undo the setting."""
    import os
    import subprocess
    import sys

    probe = (
        "import asyncio, baton.service_cli, grpc\n"
        "async def main():\n"
        "    await grpc.aio.insecure_channel('127.0.0.1:1').close()\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    bogus = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        env={**env, "GRPC_EXPERIMENTS": "-no_such_experiment"},
    )  # fmt: skip
    assert "Unknown experiment: no_such_experiment" in bogus.stderr  # the check can fail
    ours = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
    )
    assert "Unknown experiment" not in ours.stderr


def test_pin_cpus_becomes_each_services_cpus_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pin-cpus``: each child gets ``--cpus`` with its own CPU; none without the flag; too
    few CPUs for ``auto`` is an error before anything starts."""
    from shared import affinity

    names = ["scheduler", "worker-0", "gateway"]
    assert cluster().cpus(names) == {n: [] for n in names}
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: tuple(range(8)))
    assert cluster("--pin-cpus").cpus(names) == {
        "scheduler": ["--cpus", "5"], "worker-0": ["--cpus", "6"], "gateway": ["--cpus", "7"],
    }  # fmt: skip
    assert cluster("--pin-cpus", "2").cpus(names) == {n: ["--cpus", "2"] for n in names}
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: (0, 1, 2))
    with pytest.raises(RuntimeError, match="3 services need 4 CPUs"):
        cluster("--pin-cpus").cpus(names)


def test_input_limits_reach_the_gateway() -> None:
    """``baton serve --max-stop 3`` hands the gateway that flag, whose settings carry it; a
    limit left at its default is not passed on."""
    from baton.service_cli import cluster_spec, input_limits

    spec = cluster_spec(build_parser().parse_args(["serve", "--model", "m", "--max-stop", "3"]))
    assert spec.gateway_argv == ("--max-stop", "3")
    gateway = build_parser().parse_args(["gateway", "--model", "m", "--scheduler", "x:1",
                                         *spec.gateway_argv])  # fmt: skip
    limits = input_limits(gateway)
    assert limits.max_stop == 3 and limits.max_prompts == 64
    with pytest.raises(ValueError, match="max_stop must be >= 1"):
        input_limits(build_parser().parse_args(["gateway", "--model", "m", "--scheduler",
                                                "x:1", "--max-stop", "0"]))  # fmt: skip


def test_tool_call_parser_reaches_the_gateway() -> None:
    from baton.service_cli import cluster_spec

    argv = ["serve", "--model", "m", "--tool-call-parser", "hermes"]
    assert cluster_spec(build_parser().parse_args(argv)).gateway_argv == (
        "--tool-call-parser", "hermes",
    )  # fmt: skip
    assert cluster_spec(build_parser().parse_args(argv[:3])).gateway_argv == ()
    with pytest.raises(SystemExit):  # argparse: not one of the parsers
        build_parser().parse_args([*argv[:3], "--tool-call-parser", "mistral"])


def test_restart_backoff_doubles_to_its_cap_and_gives_up_past_the_bound() -> None:
    from baton.launcher import RestartPolicy

    policy = cluster("--max-restarts", "4", "--restart-delay", "2").spec.restart
    assert [policy.delay(n) for n in range(1, 6)] == [2.0, 4.0, 8.0, 8.0, None]
    assert RestartPolicy(max_restarts=0).delay(1) is None  # never restart
    with pytest.raises(ValueError):
        RestartPolicy(delay_s=-1)


def test_children_share_one_secret_kept_off_the_command_line(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("BATON_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("BATON_INTERNAL_TOKEN_FILE", raising=False)
    made = cluster().security_env
    assert len(made["BATON_INTERNAL_TOKEN"]) >= 32 and made != cluster().security_env
    token = tmp_path / "token"
    token.write_text("a-token-from-a-mounted-secret")
    env = cluster("--internal-token-file", str(token), "--internal-tls-dir", "/certs").security_env
    assert env == {"BATON_INTERNAL_TOKEN_FILE": str(token), "BATON_INTERNAL_TLS_DIR": "/certs"}


def test_every_interface_is_told_apart_from_one_address() -> None:
    from shared.internal_auth import is_unspecified

    assert all(map(is_unspecified, ["", "0.0.0.0", "::", "[::]", "0:0::0"]))
    assert not any(map(is_unspecified, ["127.0.0.1", "10.1.2.3", "::1", "worker-0.baton"]))
