"""The engine scheduler's P/D bookkeeping, driven through the in-process fake connector: a
prefill engine leases a finished prompt's blocks, a decode engine pulls them (plain tensor
copies) and decodes on; leases end on the decode side's notice or at expiry; failed and stale
pulls recompute or fail. No model, no NIXL: a step is schedule → start pulls → poll → apply →
a fake model that writes each computed token's id into its KV slot."""

from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from services.worker.engine.config import KVTransferConfig
from services.worker.engine.kv_transfer.fake_connector import FakeConnector, FakeFabric
from services.worker.engine.kv_transfer.params import KVTransferParams, RemoteKV
from services.worker.engine.kv_transfer.scheduler_side import KVTransferBookkeeping
from services.worker.engine.messages import EngineCoreOutput, ErrorCode
from services.worker.engine.request import FinishReason, Request, RequestStatus
from services.worker.engine.sched.output import SchedulerOutput
from services.worker.engine.sched.scheduler import LEASE_EXPIRED, PULL_FAILED, Scheduler
from shared.ids import RequestId
from tests.helpers import fake_run, make_request, make_scheduler

BLOCK = 4  # tokens per block (helpers.make_request)
PROMPT = 10  # tokens: blocks of 4 + 4 + 2


def write_kv(sched: Scheduler, out: SchedulerOutput, kv: torch.Tensor) -> None:
    """The fake model: each token this step computes has its id written into its KV slot."""
    for rid, n in out.num_scheduled_tokens.items():
        request = sched.requests[RequestId(rid)]
        (blocks,) = sched.kv.get_block_ids(request.request_id)
        for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
            kv[blocks[pos // BLOCK], pos % BLOCK] = float(request.all_token_ids[pos])


@dataclass
class Engine:
    """A scheduler, its KV cache and its connector, stepped as ``EngineCore`` steps them."""

    sched: Scheduler
    kv: torch.Tensor
    connector: FakeConnector
    trace: list[dict[str, int]] = field(default_factory=list)  # scheduled tokens per step
    loads: list[list[int]] = field(default_factory=list)  # local blocks of each pull started
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    @classmethod
    def make(
        cls, fabric: FakeFabric, name: str, lease_s: float = 30.0, recompute: bool = False
    ) -> "Engine":
        kv = torch.full((32, BLOCK), -1.0)
        connector = FakeConnector(name, kv, "compat", fabric=fabric)
        config = KVTransferConfig(True, name, "", lease_s, recompute, "fake")
        transfer = KVTransferBookkeeping(config, BLOCK, connector.side_channel)
        return cls(make_scheduler(num_blocks=32, transfer=transfer), kv, connector)

    @property
    def transfer(self) -> KVTransferBookkeeping:
        assert self.sched.transfer is not None
        return self.sched.transfer

    def step(self) -> list[EngineCoreOutput]:
        so = self.sched.schedule()
        write_kv(self.sched, so, self.kv)
        failed = self.connector.start_loads(so.kv_loads)
        results = self.connector.poll()
        results.failed = failed + results.failed
        outs = self.sched.update_from_transfers(results)
        outs += self.sched.update_from_output(so, fake_run(self.sched, so))
        self.trace.append(dict(so.num_scheduled_tokens))
        self.loads += [load.local_block_ids for load in so.kv_loads]
        self.outputs += outs
        return outs

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def all_free(self) -> bool:
        return self.sched.kv.num_free_blocks == self.sched.kv.pool.num_blocks

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs if o.request_id == rid for t in o.new_token_ids]


def prefill_leg(engine: Engine, rid: str = "p", first_token: int = 1) -> tuple[RemoteKV, int]:
    """Run a prompt as a prefill leg; its KV handle and the first token it sampled."""
    request = make_request(rid, PROMPT, max_tokens=1, first_token=first_token)
    request.attach_kv_transfer(KVTransferParams(do_remote_decode=True))
    engine.sched.add_request(request)
    [out] = engine.step()
    assert out.kv_handle is not None and out.finish_reason == FinishReason.LENGTH
    return out.kv_handle, out.new_token_ids[0]


def decode_leg(
    engine: Engine, handle: RemoteKV, token: int, rid: str = "d", first_token: int = 1
) -> Request:
    request = make_request(rid, PROMPT, max_tokens=4, first_token=first_token)
    request.attach_kv_transfer(KVTransferParams(remote=handle, first_token_id=token))
    engine.sched.add_request(request)
    return request


CASES = [
    # name, fabric latency (polls), prompt blocks the decode engine already holds, its trace
    ("pulled in the step that starts it", 0, 0, [{}, {"d": 1}, {"d": 1}, {"d": 1}, {}]),
    ("pulled two polls later", 2, 0, [{}, {}, {}, {"d": 1}, {"d": 1}, {"d": 1}, {}]),
    ("a held prefix is not pulled", 0, 2, [{}, {"d": 1}, {"d": 1}, {"d": 1}, {}]),
]


@pytest.mark.parametrize(("name", "latency", "held", "expected"), CASES, ids=[c[0] for c in CASES])
def test_pull_then_decode(name: str, latency: int, held: int, expected: list) -> None:
    fabric = FakeFabric(latency_polls=latency)
    prefill, decode = Engine.make(fabric, "prefill"), Engine.make(fabric, "decode")
    if held:  # the decode engine computed the prompt's first blocks for another request
        decode.sched.add_request(make_request("x", held * BLOCK + 1, max_tokens=1))
        decode.run(1)
        decode.trace.clear()
    handle, token = prefill_leg(prefill)
    assert not prefill.all_free()  # leased, not freed
    request = decode_leg(decode, handle, token)
    decode.run(len(expected))
    assert decode.trace == expected
    assert [len(blocks) for blocks in decode.loads] == [3 - held]  # one pull, of the rest
    assert request.num_cached_tokens == held * BLOCK
    assert (
        decode.tokens("d") == [7, 7, 7] and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    )
    prefill.run(1)  # its poll sees the decode side's notice
    assert prefill.transfer.num_released == 1 and not prefill.transfer.leases
    assert prefill.all_free() and decode.all_free()


def test_pulled_kv_is_the_prefill_engines() -> None:
    fabric = FakeFabric(latency_polls=1)
    prefill, decode = Engine.make(fabric, "prefill"), Engine.make(fabric, "decode")
    handle, token = prefill_leg(prefill, first_token=40)
    request = decode_leg(decode, handle, token, first_token=40)
    decode.run(2)  # the pull ends in the second step's poll; nothing is decoded yet
    assert request.kv_ready and decode.trace == [{}, {}]
    (blocks,) = decode.sched.kv.get_block_ids(request.request_id)
    pulled = decode.kv[blocks].flatten()[:PROMPT].tolist()
    assert pulled == [float(t) for t in range(40, 40 + PROMPT)]
    assert decode.kv[blocks].tolist() == prefill.kv[handle.block_ids].tolist()


@pytest.mark.parametrize("fault", ["kill", "fail_next"])
@pytest.mark.parametrize("recompute", [False, True], ids=["error", "recompute"])
def test_failed_pull(fault: str, recompute: bool) -> None:
    fabric = FakeFabric(latency_polls=1)
    prefill = Engine.make(fabric, "prefill")
    decode = Engine.make(fabric, "decode", recompute=recompute)
    handle, token = prefill_leg(prefill)
    request = decode_leg(decode, handle, token)
    decode.run(1)  # the pull is in flight
    assert request.request_id in decode.transfer.loading
    if fault == "kill":
        fabric.kill(handle.side_channel)
    else:
        fabric.fail_next.add("d")
    decode.run(6)
    assert not decode.transfer.loading
    if recompute:  # the prompt and the handed-over token, computed here; then decodes on
        assert decode.trace[:3] == [{}, {}, {"d": PROMPT + 1}]  # failure seen in step 2
        assert decode.tokens("d") == [7, 7, 7]
    else:
        [out] = decode.outputs
        assert out.finish_reason == FinishReason.ERROR and out.error == PULL_FAILED
        assert out.error_code == ErrorCode.KV_TRANSFER_FAILED and out.new_token_ids == []
        assert all(step == {} for step in decode.trace)
    assert decode.all_free() and not decode.sched.has_requests()


def test_unpulled_lease_expires() -> None:
    prefill = Engine.make(FakeFabric(), "prefill", lease_s=0.0)
    prefill_leg(prefill)
    assert prefill.transfer.leases
    prefill.run(1)  # its next schedule ends every lease past its expiry
    assert not prefill.transfer.leases and prefill.transfer.num_expired == 1
    assert prefill.all_free() and not prefill.sched.needs_polling()


@pytest.mark.parametrize("recompute", [False, True], ids=["error", "recompute"])
def test_stale_handle_is_not_read(recompute: bool) -> None:
    """A decode leg that waited past its handle's lease never reads: the prefill engine may
    have given those blocks to another prompt."""
    fabric = FakeFabric()
    prefill = Engine.make(fabric, "prefill", lease_s=0.0)
    decode = Engine.make(fabric, "decode", recompute=recompute)
    handle, token = prefill_leg(prefill)
    request = decode_leg(decode, handle, token)
    decode.run(5)
    assert decode.loads == [] and decode.transfer.num_stale == 1
    if recompute:
        assert decode.trace[0] == {"d": PROMPT + 1} and decode.tokens("d") == [7, 7, 7]
    else:
        [out] = decode.outputs
        assert out.error == LEASE_EXPIRED and out.error_code == ErrorCode.KV_TRANSFER_FAILED
        assert request.status == RequestStatus.FINISHED_ERROR
    assert decode.all_free() and not decode.sched.has_requests()


def test_notice_after_the_lease_expired_ends_nothing() -> None:
    """A pull that started in time but completes after the prefill engine's lease expired: the
    late notice frees nothing twice, and counts no release."""
    fabric = FakeFabric(latency_polls=2)
    prefill = Engine.make(fabric, "prefill", lease_s=0.0)
    decode = Engine.make(fabric, "decode")
    handle, token = prefill_leg(prefill)
    fresh = msgspec.structs.replace(handle, lease_expires_at=handle.lease_expires_at + 60)
    decode_leg(decode, fresh, token)  # as if the decode side had started before expiry
    decode.run(1)
    prefill.run(1)  # the lease expires: its blocks are free (and could hold another prompt)
    assert prefill.all_free() and prefill.transfer.num_expired == 1
    decode.run(4)  # the pull completes and notifies; two tokens decoded
    prefill.run(2)
    assert prefill.all_free() and prefill.transfer.num_released == 0
    assert decode.tokens("d") == [7, 7]


def test_abort_while_pulling_frees_after_the_pull() -> None:
    fabric = FakeFabric(latency_polls=2)
    prefill, decode = Engine.make(fabric, "prefill"), Engine.make(fabric, "decode")
    handle, token = prefill_leg(prefill)
    decode_leg(decode, handle, token)
    decode.run(1)
    decode.sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert not decode.all_free()  # the pull still writes into its blocks
    decode.run(3)
    assert decode.all_free() and not decode.transfer.loading and decode.outputs == []
    prefill.run(1)
    assert prefill.all_free() and prefill.transfer.num_released == 1


def test_aborted_prefill_leg_releases_its_lease() -> None:
    prefill = Engine.make(FakeFabric(), "prefill")
    prefill_leg(prefill)
    prefill.sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert prefill.all_free() and prefill.transfer.num_released == 1


class SlowGrammar:
    """A request's grammar as the scheduler sees it (structured/manager.RequestGrammar), whose
    compilation ends when the test says."""

    def __init__(self) -> None:
        self.compiled = False
        self.matcher: object | None = None
        self.error: str | None = None
        self.accepted: list[int] = []
        self.terminated = False

    def ready(self, output_token_ids: list[int]) -> bool:
        if self.compiled and self.matcher is None:
            self.matcher, self.accepted = object(), list(output_token_ids)
        return self.matcher is not None

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True


def test_a_decode_leg_pulls_while_its_grammar_compiles() -> None:
    """The pull starts at once; decoding waits for the grammar, whose matcher starts from the
    prefill leg's first token."""
    fabric = FakeFabric()
    prefill, decode = Engine.make(fabric, "prefill"), Engine.make(fabric, "decode")
    handle, token = prefill_leg(prefill, first_token=3)
    request = decode_leg(decode, handle, token)
    grammar = SlowGrammar()
    request.grammar = grammar  # type: ignore[assignment]
    decode.run(3)
    assert len(decode.loads) == 1 and request.kv_ready  # pulled, not decoded
    assert decode.trace == [{}, {}, {}] and decode.sched.waiting_for_grammars() == [grammar]
    grammar.compiled = True
    decode.run(4)
    assert decode.trace[3:] == [{"d": 1}, {"d": 1}, {"d": 1}, {}]
    assert grammar.accepted == [token, 7, 7, 7] and decode.tokens("d") == [7, 7, 7]
