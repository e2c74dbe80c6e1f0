"""A worker that finds the scheduler replicas through a DNS name (``--scheduler dns:NAME:PORT``)
dials each replica's IP address; with internal TLS the replica's certificate names the service,
not each pod's IP, so the channel checks it against NAME (``channel(address, tls_name)``)."""

import datetime
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shared import rpc
from shared.internal_auth import Security
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc

NAME = "rel-baton-scheduler-headless.serving.svc"


def certificates(d: Path, dns_name: str) -> None:
    """A CA and one certificate it signs, naming ``dns_name`` only (no IP address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])

    def builder(subject: str, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(ca_name).public_key(public)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=1))
                .not_valid_after(now + datetime.timedelta(days=1)))  # fmt: skip

    ca = (
        builder("test-ca", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf = (
        builder("baton", key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (d / "tls.key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip


class Scheduler(scheduler_pb2_grpc.GlobalSchedulerServicer):
    async def ListWorkers(self, request, context):  # type: ignore[no-untyped-def]
        return scheduler_pb2.ListWorkersResponse()


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[None]:
    certificates(tmp_path, NAME)
    before = rpc.security()
    rpc.configure(Security(token="t" * 32, tls_dir=str(tmp_path)))
    yield
    rpc.configure(before)


async def answers(address: str, tls_name: str | None) -> bool:
    async with rpc.channel(address, tls_name) as ch:
        try:
            await scheduler_pb2_grpc.GlobalSchedulerStub(ch).ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=3, metadata=rpc.auth()
            )
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
            return False
    return True


async def test_an_address_found_by_name_is_checked_against_the_name(tls: None) -> None:
    server = rpc.server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(Scheduler(), server)
    port = rpc.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert not await answers(address, None)  # the certificate names no IP address
        assert await answers(address, NAME)
        assert not await answers(address, "another.name")
    finally:
        await server.stop(0)
