"""``http_edge.connection_cap``: --max-connections fitted to the process's descriptor limit,
the soft limit raised to the hard one first (the limits faked, nothing is changed)."""

import resource

import pytest

from services.gateway import http_edge
from services.gateway.settings import EdgeLimits

INF = resource.RLIM_INFINITY
RESERVED = http_edge.RESERVED_FDS


@pytest.mark.parametrize(
    ("soft", "hard", "settable", "wanted", "cap", "raised_to"),
    [
        (1024, 524288, True, 4096, 4096, 524288),  # a container's 1,024: raised, all fit
        (1024, INF, True, 4096, 4096, INF),
        (1024, 1024, True, 4096, 1024 - RESERVED, None),  # nothing to raise: lowered
        (1024, 524288, False, 4096, 1024 - RESERVED, 524288),  # not allowed to raise it
        (INF, INF, True, 4096, 4096, None),
        (100, 100, True, 4096, 1, None),  # fewer descriptors than reserved: still one
        (65536, 65536, True, 20, 20, None),
    ],
)
def test_connection_cap(
    monkeypatch: pytest.MonkeyPatch,
    soft: int, hard: int, settable: bool, wanted: int, cap: int, raised_to: int | None,
) -> None:  # fmt: skip
    calls: list[tuple[int, int]] = []

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        calls.append(limits)
        if not settable:
            raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert http_edge.connection_cap(wanted) == cap
    assert calls == ([] if raised_to is None else [(raised_to, raised_to)])


def test_the_protocol_is_httptools_bound_to_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn gets a class of its httptools protocol (never h11's), carrying the fitted cap."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1024))
    cls = http_edge.protocol(EdgeLimits(header_timeout_s=2.0))
    assert issubclass(cls, HttpToolsProtocol)
    assert cls.limits == EdgeLimits(header_timeout_s=2.0, max_connections=1024 - RESERVED)
