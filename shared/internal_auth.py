"""The shared secret and the certificates of Baton's internal connections, read from files or
the environment (no gRPC here: the launcher reads the names too). ``shared/rpc.py`` applies
them to every channel and server; the NIXL side channel authenticates with the same token."""

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "BATON_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "BATON_INTERNAL_TOKEN_FILE"
TLS_DIR_ENV = "BATON_INTERNAL_TLS_DIR"
MIN_TOKEN_CHARS = 16


def is_unspecified(host: str) -> bool:
    """``host`` means every interface (0.0.0.0, ::, empty): nothing internal may listen there
    unless the operator asked for it."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a name: it resolves to one address


@dataclass(frozen=True, repr=False)  # (no repr: the token must not reach a log line)
class Security:
    token: str | None = None
    tls_dir: str | None = None  # tls.crt, tls.key, ca.crt

    @classmethod
    def load(cls, token_file: str | None = None, tls_dir: str | None = None) -> "Security":
        """From the flags, else the environment: ``--internal-token-file`` /
        BATON_INTERNAL_TOKEN_FILE (a mounted Secret) or BATON_INTERNAL_TOKEN, and
        ``--internal-tls-dir`` / BATON_INTERNAL_TLS_DIR."""
        token_file = token_file or os.environ.get(TOKEN_FILE_ENV)
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV)
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the internal token must have at least {MIN_TOKEN_CHARS} characters")
        tls_dir = tls_dir or os.environ.get(TLS_DIR_ENV) or None
        if tls_dir is not None:
            files = ("tls.crt", "tls.key", "ca.crt")
            missing = [f for f in files if not (Path(tls_dir) / f).is_file()]
            if missing:
                raise ValueError(f"{tls_dir} lacks {', '.join(missing)}")
        return cls(token or None, tls_dir)

    def require_token(self, service: str) -> "Security":
        if self.token is None:
            raise SystemExit(
                f"baton {service}: no internal token. Give every service the same secret in "
                f"{TOKEN_ENV} or a file named by --internal-token-file / {TOKEN_FILE_ENV} "
                "(baton serve makes one for its services; the Helm chart mounts a Secret)"
            )
        return self

    def files(self) -> tuple[bytes, bytes, bytes]:
        """(CA, key, certificate), as gRPC takes them."""
        d = Path(self.tls_dir or "")
        return ((d / "ca.crt").read_bytes(), (d / "tls.key").read_bytes(),
                (d / "tls.crt").read_bytes())  # fmt: skip
