"""Errors the gateway returns, in OpenAI's JSON shape, each with its HTTP status. Mapped once:
routes raise ``APIError``; the app's handlers turn it (and validation errors) into a response.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

A check inside a pydantic validator (schemas.py) that refuses a field raises ``refuse(param,
message)``: a ``PydanticCustomError`` of its own type carrying the field's path, which
``from_validation`` turns into the 400 naming it (a model-level validator has no location of
its own, and a plain ValueError would read "Value error, ...").
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from pydantic_core import PydanticCustomError

from shared.protos.baton.v1 import worker_pb2


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


REFUSED = "baton_refused"  # the pydantic error type of ``refuse``


def refuse(param: str, message: str) -> PydanticCustomError:
    """Raise it in a validator: a 400 whose ``param`` is ``param`` (a dotted path such as
    ``messages.0.content.1``) and whose message is ``message``, as written."""
    # (pydantic fills "{key}" in the message from the context: the key is one no message says)
    return PydanticCustomError(REFUSED, message, {"refused_param": param})


def from_validation(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first of pydantic's errors (with their context) as OpenAI's 400."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    ctx = first.get("ctx") or {}
    if first.get("type") == REFUSED:
        return bad_request(str(first["msg"]), str(ctx["refused_param"]))
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = str(ctx["error"]) if first.get("type") == "value_error" else str(first["msg"])
    where = ".".join(loc)
    return bad_request(f"{where}: {message}" if where else message, loc[0] if loc else None)


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def unauthorized() -> APIError:
    return APIError(
        401, "Invalid or missing API key", type="authentication_error", code="invalid_api_key"
    )


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds {limit} bytes", code="request_too_large")


def no_worker(detail: str) -> APIError:
    return APIError(503, f"No worker can serve this request: {detail}", type="server_error",
                    code="no_worker_available")  # fmt: skip


def not_ready(detail: str) -> APIError:
    return APIError(503, f"Not ready: {detail}", type="server_error", code="not_ready")


def timeout(what: str) -> APIError:
    return APIError(504, f"Timed out: {what}", type="server_error", code="timeout")


# the HTTP edge's refusals (http_edge.py, app.py ``_parse``): the client's fault, or the load's
def request_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s",
                    code="request_timeout")  # fmt: skip


def head_too_large(limit: int) -> APIError:
    return APIError(431, f"The request line and headers exceed {limit} bytes",
                    code="request_header_too_large")  # fmt: skip


def too_many_connections(limit: int) -> APIError:
    return APIError(503, f"This gateway holds its most connections ({limit}); retry",
                    type="server_error", code="too_many_connections")  # fmt: skip


def from_engine(code: worker_pb2.ErrorCode, message: str) -> APIError:
    """A request the worker's engine ended in error, by the kind the protos give it."""
    if code == worker_pb2.ERROR_CODE_INVALID_REQUEST:
        return bad_request(message)
    if code == worker_pb2.ERROR_CODE_KV_TRANSFER_FAILED:
        return APIError(502, message, type="server_error", code="kv_transfer_failed")
    if code == worker_pb2.ERROR_CODE_OVERLOADED:
        return APIError(503, message, type="server_error", code="overloaded")
    return APIError(500, message, type="server_error", code="engine_error")


def from_grpc(e: grpc.aio.AioRpcError, what: str) -> APIError:
    """A failed call to the scheduler or a worker, as the client should see it."""
    return from_status(e.code(), e.details() or e.code().name, what)


def from_status(code: grpc.StatusCode, detail: str, what: str) -> APIError:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(detail)
    if code == grpc.StatusCode.NOT_FOUND:
        return APIError(404, detail, param="model", code="model_not_found")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return timeout(what)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return no_worker(f"{what}: {detail}")
    return APIError(502, f"{what} failed: {detail}", type="server_error", code="upstream_error")
