"""``GatewaySettings``: what ``baton gateway`` is configured with, built once and frozen."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GatewaySettings:
    scheduler_address: str
    models: dict[str, str] = field(hash=False)  # served model name → tokenizer directory
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0  # no request runs longer than this
    generate_stream: bool = True  # Generate over one long-lived stream per worker (else unary)
    log_level: str = "info"
    cpus: tuple[int, ...] = ()  # pin every thread here once serving (shared/affinity.py)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the gateway needs at least one model (name → tokenizer dir)")
        if self.max_body_bytes <= 0 or self.request_timeout_s <= 0:
            raise ValueError("max_body_bytes and request_timeout_s must be > 0")
