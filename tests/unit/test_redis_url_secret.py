"""The global scheduler's Redis URL, which may hold a password: given in a file
(``--redis-url-file``, a mounted Secret) or the environment (``BATON_REDIS_URL``) instead of
on the command line, and never printed with its password (``redacted``)."""

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from baton.cli import build_parser
from baton.service_cli import scheduler_settings
from services.global_scheduler.main import serve
from services.global_scheduler.settings import REDIS_URL_ENV, SchedulerSettings, redacted
from shared import rpc
from shared.lifecycle import StopSignal
from shared.protos.baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

SECRET = "hunter2-not-for-logs"
URL = f"redis://baton:{SECRET}@redis.example:6379/0"


def settings(*argv: str) -> SchedulerSettings:
    return scheduler_settings(build_parser().parse_args(["global-scheduler", *argv]))


def test_the_url_comes_from_the_flag_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    assert settings().redis_url is None  # none: the directory in memory
    secret = tmp_path / "redis-url"
    secret.write_text(f"  {URL}\n")  # as a Secret mounted from a file with a newline
    assert settings("--redis-url-file", str(secret)).redis_url == URL
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:from-env@h:1/2")
    assert settings().redis_url == "redis://:from-env@h:1/2"
    assert settings("--redis-url-file", str(secret)).redis_url == URL  # a flag wins
    assert settings("--redis-url", "redis://h:3/0").redis_url == "redis://h:3/0"


def test_a_missing_or_empty_url_file_is_a_clean_error(tmp_path: Path) -> None:
    missing, empty = tmp_path / "absent", tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(SystemExit, match=f"baton global-scheduler: --redis-url-file {missing}: "):
        settings("--redis-url-file", str(missing))
    with pytest.raises(SystemExit, match=f"--redis-url-file {empty} is empty"):
        settings("--redis-url-file", str(empty))


def test_the_url_and_its_file_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings("--redis-url", URL, "--redis-url-file", "f")
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (URL, "redis://baton:***@redis.example:6379/0"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://pw@h/0", "rediss://***@h/0"),  # a lone name may be a password
        ("redis://u:p%40ss@h/0?password=x&db=1", "redis://u:***@h/0?password=***&db=1"),
        ("redis://u:p@ss@h/0", "redis://u:***@h/0"),  # an unquoted @ in the password
        ("unix://:pw@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        ("redis://h:6379/0", "redis://h:6379/0"),  # nothing to hide
        ("redis://:pw@[::1/0", "redis://***"),  # malformed: nothing of it shown
    ],
)
def test_redacted(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_the_settings_repr_hides_the_url() -> None:
    assert SECRET not in repr(SchedulerSettings(redis_url=URL))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_password_never_reaches_the_scheduler_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler whose Redis is down: its start and the failure of the directory (a worker
    registers and leaves, which the directory is told) are logged without the password."""
    port = closed_port()
    url = f"redis://baton:{SECRET}@127.0.0.1:{port}/0"
    ready = tmp_path / "ready.json"
    stop = StopSignal()
    caplog.set_level(logging.DEBUG)
    task = asyncio.create_task(
        serve(SchedulerSettings(port=0, redis_url=url, ready_file=str(ready)), stop)
    )
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert time.monotonic() < deadline and not task.done(), "the scheduler did not start"
            await asyncio.sleep(0.01)
        address = json.loads(ready.read_text())["address"]
        async with rpc.channel(address) as channel:
            stub = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
            async for _ in stub.Heartbeat(_register_and_leave(), metadata=rpc.auth()):
                pass  # ends once the scheduler removed the worker (the directory failed)
    finally:
        stop.trigger()
        await task
    assert f"redis://baton:***@127.0.0.1:{port}/0" in caplog.text
    assert "prefix directory unreachable" in caplog.text
    assert SECRET not in caplog.text


async def _register_and_leave() -> AsyncIterator[scheduler_pb2.WorkerHeartbeat]:
    yield scheduler_pb2.WorkerHeartbeat(registration=scheduler_pb2.WorkerRegistration(
        worker_id="w0", incarnation="i0", role=common_pb2.WORKER_ROLE_BOTH,
        address="127.0.0.1:1", model="m", max_model_len=512, block_size=16, num_kv_blocks=64,
    ))  # fmt: skip
