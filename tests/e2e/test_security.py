"""Closed doors of a running ``baton serve`` (P/D): every listening socket of every process is
bound to the configured address and none answers without the internal secret; a worker
registration without the token is refused; internal TLS with mutual authentication when
certificates are given; no service starts without a token."""

import datetime
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import zmq

from baton.launcher import Cluster
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import internal_channel, list_workers, long_prompt, running_cluster

MODEL = "qwen3"


@pytest.fixture(scope="module")
def pd(tiny_model: Path) -> Iterator[Cluster]:
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--worker-metrics") as c:  # fmt: skip
        yield c


def _tree(cluster: Cluster) -> list[psutil.Process]:
    procs = []
    for p in cluster.procs.values():
        proc = psutil.Process(p.pid)
        procs += [proc, *proc.children(recursive=True)]
    return procs


def _listening(proc: psutil.Process) -> list[tuple[str, int]]:
    """(address, port) of its listening sockets; an IPv4-mapped address as IPv4 (gRPC binds
    a dual-stack socket: ::ffff:127.0.0.1 reaches 127.0.0.1 only)."""
    out = []
    for c in proc.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN:
            ip = ipaddress.ip_address(c.laddr.ip)
            mapped = getattr(ip, "ipv4_mapped", None)
            out.append((str(mapped or ip), c.laddr.port))
    return out


def _zmq_probe(port: int, hello: bytes = b"info") -> bytes | None:
    """What a ZMQ REQ without the secret gets from ``port``: None when nothing ZMQ answers."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 1000)
    req.setsockopt(zmq.SNDTIMEO, 1000)
    try:
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(
            hello
        )  # (b"info": what a caller who knows the old protocol but not the secret sends)
        return bytes(req.recv())
    except zmq.Again:
        return None
    finally:
        req.close()
        ctx.term()


def _grpc_refuses(address: str, service: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        try:
            if service == "scheduler":
                scheduler_pb2_grpc.GlobalSchedulerStub(ch).ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=5
                )
            else:
                worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_every_listening_socket_is_bound_and_needs_the_secret(
    pd: Cluster, tiny_model: Path
) -> None:
    """Enumerate every LISTEN socket of the launcher's children and their children (the engine
    cores): all on 127.0.0.1 (the configured address), and each one either the public API
    (the gateway, behind API keys), a /metrics page (read-only, on the configured address), a
    gRPC server that answers UNAUTHENTICATED, the KV side channel that answers a caller
    without the secret with nothing, or a UCX listener (bound, no protocol of ours)."""
    # a disaggregated request first: the decode worker has met its peer, UCX is wired up
    body = {"model": MODEL, "prompt": long_prompt(tiny_model, 200, "doors"), "max_tokens": 4}
    assert httpx.post(f"{pd.url}/completions", json=body, timeout=60).status_code == 200
    grpc_ports = {int(pd.ready[n]["address"].rsplit(":", 1)[1]): n for n in pd.ready}
    metrics_ports = {int(r["metrics_port"]) for r in pd.ready.values() if r.get("metrics_port")}
    gateway_port = int((pd.url or "").rsplit(":", 1)[1].split("/")[0])
    seen: dict[str, int] = {"grpc": 0, "side channel": 0, "ucx": 0}
    for proc in _tree(pd):
        core = any("core_proc" in part for part in proc.cmdline())
        side_channels = 0
        for ip, port in _listening(proc):
            assert ip == "127.0.0.1", (proc.cmdline(), ip, port)
            if port == gateway_port or port in metrics_ports:
                continue
            if port in grpc_ports:
                service = "scheduler" if grpc_ports[port] == "scheduler" else "worker"
                assert _grpc_refuses(f"127.0.0.1:{port}", service) == (
                    grpc.StatusCode.UNAUTHENTICATED), (grpc_ports[port], port)  # fmt: skip
                seen["grpc"] += 1
                continue
            assert core, ("an unexpected listener", proc.cmdline(), port)
            answer = _zmq_probe(port)
            if answer is not None:
                assert answer == b"", "the side channel answered without the secret"
                assert _zmq_probe(port, b"x" * 10_000) is None  # too big: dropped unanswered
                assert _zmq_probe(port) == b""  # and it serves on
                side_channels += 1
                seen["side channel"] += 1
            else:
                seen["ucx"] += 1
        assert side_channels <= 1
    assert seen["grpc"] == 3 and seen["side channel"] == 2, seen


def test_a_registration_without_the_token_is_refused(pd: Cluster) -> None:
    """Whoever reaches the scheduler without the token cannot register (and so never gets a
    prompt), nor list the workers; a wrong token is refused alike. A worker refuses a
    Generate (and with it a caller-supplied KV handle) from a caller without the token."""
    address = pd.ready["scheduler"]["address"]
    registration = scheduler_pb2.WorkerRegistration(
        worker_id="intruder",
        incarnation="x",
        address="127.0.0.1:1",
        model=MODEL,
        max_model_len=1024,
        block_size=16,
        num_kv_blocks=64,
    )
    for metadata in ((), (("authorization", "Bearer not-the-token-at-all"),)):
        with grpc.insecure_channel(address) as ch:
            stream = scheduler_pb2_grpc.GlobalSchedulerStub(ch).Heartbeat(
                iter([scheduler_pb2.WorkerHeartbeat(registration=registration)]),
                metadata=metadata, timeout=5,
            )  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                list(stream)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "intruder" not in {w.registration.worker_id for w in list_workers(pd)}
    with grpc.insecure_channel(pd.ready["decode-0"]["address"]) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).Generate(
            worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3]), timeout=5
        )
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with internal_channel(address) as ch:  # the same call with the token is answered
        scheduler_pb2_grpc.GlobalSchedulerStub(ch).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5
        )


def test_decode_reads_only_from_registered_prefill_workers(pd: Cluster, tiny_model: Path) -> None:
    """A token holder hands the decode worker a KV handle pointing at a socket that is no
    prefill worker the scheduler registered: the worker never connects to it, and (by
    default) recomputes the prompt, giving the text the real P/D path gives."""
    import time

    from shared.protos.baton.v1 import common_pb2
    from shared.text.tokenizer import TextTokenizer
    from tests.e2e.conftest import scheduler_metric

    ids = TextTokenizer(tiny_model).encode(long_prompt(tiny_model, 100, "rogue-handle"))
    greedy = common_pb2.SamplingParams(temperature=0, max_tokens=6)
    with internal_channel(pd.ready["prefill-0"]["address"]) as ch:  # a real prefill leg
        real = worker_pb2_grpc.WorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
            request_id="rogue-ref", prompt_token_ids=ids, params=greedy, keep_kv=False,
        ), timeout=30)  # fmt: skip
    ctx = zmq.Context()
    trap = ctx.socket(zmq.REP)  # where the rogue handle points: it must hear nothing
    port = trap.bind_to_random_port("tcp://127.0.0.1")
    rogue = common_pb2.KVHandle(
        engine_id="rogue", side_channel=f"tcp://127.0.0.1:{port}",
        block_ids=list(range(-(-len(ids) // 16))), num_tokens=len(ids),
        lease_expires_at=time.time() + 60, request_id="rogue",
    )  # fmt: skip
    before = scheduler_metric(pd, "baton_worker_kv_handles_refused_total", "decode-0")
    try:
        with internal_channel(pd.ready["decode-0"]["address"]) as ch:
            outs = list(worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                request_id="rogue-leg", prompt_token_ids=ids, params=greedy, remote_kv=rogue,
                first_token_id=real.first_token_id,
            ), timeout=30))  # fmt: skip
        assert trap.poll(500) == 0, "the decode worker connected to an unregistered peer"
    finally:
        trap.close(linger=0)
        ctx.term()
    tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
    with internal_channel(pd.ready["decode-0"]["address"]) as ch:  # the same, computed here
        plain = list(worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
            request_id="rogue-plain", prompt_token_ids=[*ids, real.first_token_id],
            params=common_pb2.SamplingParams(temperature=0, max_tokens=5),
        ), timeout=30))  # fmt: skip
    assert tokens == [t for o in plain for d in o.deltas for t in d.token_ids]
    assert len(tokens) == 5
    after = scheduler_metric(pd, "baton_worker_kv_handles_refused_total", "decode-0")
    assert after == before + 1


def test_no_service_starts_without_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_INTERNAL")}
    out = subprocess.run([sys.executable, "-m", "baton.cli", "global-scheduler", "--port", "0"],
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "no internal token" in out.stderr, out.stderr
    short = tmp_path / "token"
    short.write_text("short")
    out = subprocess.run([sys.executable, "-m", "baton.cli", "global-scheduler", "--port", "0",
                          "--internal-token-file", str(short)], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "at least 16 characters" in out.stderr, out.stderr
    # a worker on every interface must name the one address its KV side channel and UCX use
    out = subprocess.run([sys.executable, "-m", "baton.cli", "worker", "--model", "m",
                          "--role", "decode", "--host", "0.0.0.0"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "--advertise-host" in out.stderr, out.stderr


def _certificates(d: Path) -> None:
    """A CA, and one certificate it signs (for 127.0.0.1) that every service presents."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
             signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:  # fmt: skip
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=1))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None),
                            critical=True))  # fmt: skip
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ), critical=False)  # fmt: skip
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "baton-test-ca")])
    ca = cert("baton-test-ca", ca_key, ca_name, ca_key, True)
    leaf = cert("baton", key, ca_name, ca_key, False)
    pem = serialization.Encoding.PEM
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (d / "tls.key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip


def test_internal_tls_with_mutual_authentication(tiny_model: Path, tmp_path: Path) -> None:
    """With ``--internal-tls-dir`` every internal connection is TLS: the system serves; a
    plaintext caller gets nothing, nor does a TLS caller without a client certificate."""
    _certificates(tmp_path)
    with running_cluster(tiny_model, 1, "--internal-tls-dir", str(tmp_path)) as cluster:
        body = {"model": MODEL, "prompt": "over TLS", "max_tokens": 4}
        assert httpx.post(f"{cluster.url}/completions", json=body, timeout=60).status_code == 200
        address = cluster.ready["scheduler"]["address"]
        assert _grpc_refuses(address, "scheduler") == grpc.StatusCode.UNAVAILABLE  # plaintext
        ca = (tmp_path / "ca.crt").read_bytes()
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as ch:  # no cert
            with pytest.raises(grpc.RpcError) as e:
                scheduler_pb2_grpc.GlobalSchedulerStub(ch).ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=5
                )
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        creds = grpc.ssl_channel_credentials(ca, (tmp_path / "tls.key").read_bytes(),
                                             (tmp_path / "tls.crt").read_bytes())  # fmt: skip
        token = (("authorization", f"Bearer {os.environ['BATON_INTERNAL_TOKEN']}"),)
        with grpc.secure_channel(address, creds) as ch:  # certificate and token: answered
            workers = (
                scheduler_pb2_grpc.GlobalSchedulerStub(ch)
                .ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5, metadata=token)
                .workers
            )
        assert len(workers) == 1


def test_serve_api_key_file_protects_the_gateway(tiny_model: Path, tmp_path: Path) -> None:
    """``baton serve --api-key-file`` (and an ``--api-key`` beside it): without one of those
    keys ``/v1/*`` is a 401, with one it answers, and no child's command line holds a key (the
    gateway reads them from a file). The served name holds a slash, as a Hugging Face id does:
    ``GET /v1/models/{id}`` finds it."""
    first, second, third = "first-key-7c1d0e9a5b", "second-key-3f8a2b6c4d", "third-key-9e2f4a"
    keys = tmp_path / "api-keys"
    keys.write_text(f"# one key a line\n{first}\n\n{second}\n")
    name = "org/tiny"
    with running_cluster(tiny_model, 1, "--api-key-file", str(keys), "--api-key", third,
                         "--served-model-name", name) as cluster:  # fmt: skip
        url = cluster.url or ""
        body = {"model": name, "prompt": "keyed", "max_tokens": 4}
        for headers in ({}, {"authorization": "Bearer not-a-key"}):
            got = httpx.get(f"{url}/models/{name}", headers=headers, timeout=10)
            assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key"
            got = httpx.post(f"{url}/completions", json=body, headers=headers, timeout=60)
            assert got.status_code == 401
        for key in (first, second, third):
            auth = {"authorization": f"Bearer {key}"}
            got = httpx.get(f"{url}/models/{name}", headers=auth, timeout=10)
            assert got.status_code == 200 and got.json()["id"] == name, got.text
            got = httpx.post(f"{url}/completions", json=body, headers=auth, timeout=60)
            assert got.status_code == 200, got.text
        assert httpx.get(url.removesuffix("/v1") + "/ready", timeout=10).status_code == 200
        for proc in _tree(cluster):
            assert not any(k in " ".join(proc.cmdline()) for k in (first, second, third))
