"""Start and stop a real ``redis-server`` for tests: a free port, no persistence, readiness by
PING (bounded), stopped by pid. Also restartable on the same port (the outage tests)."""

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

from baton.launcher import free_port

START_TIMEOUT_S = 10.0


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, port: int | None = None) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make install`")
        port = port or free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        return cls(port, proc)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Start again on the same port (empty, like a Redis that lost its data)."""
        self.proc = RedisServer.start(self.port).proc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
