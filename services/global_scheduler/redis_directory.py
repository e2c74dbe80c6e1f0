"""``RedisDirectory``: the prefix directory in Redis, shared by every scheduler replica, so the
replicas hold no routing state of their own.

Keys (``prefix`` defaults to ``baton:``; hashes in hex)::

    {prefix}b:{hash}             SET of "{incarnation}:{worker}" that hold the block
    {prefix}h:{incarnation}:{w}  SET of the hashes that incarnation holds (for clear/purge)
    {prefix}s:{incarnation}:{w}  the last applied KV-event batch seq of that incarnation

A batch is applied by one Lua script (atomic, and skipped when its seq is not new, so replicas
that all receive a worker's events apply each batch once). A lookup is one pipelined round
trip of SMEMBERS; members of incarnations that are not live never count. ``forget`` purges an
incarnation's entries (the server calls it off the routing path). Every call has a short
timeout and no retries: when Redis is down the caller learns it at once
(``DirectoryUnavailable``) and routes on load alone. Keys are computed inside the scripts, so
this targets a single Redis (or a primary with replicas), not Redis Cluster.
"""

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from services.global_scheduler.directory import DirectoryUnavailable
from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_APPLY = """
local prefix, member, held, seqkey = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local seq = tonumber(ARGV[5])
if seq <= tonumber(redis.call('GET', seqkey) or '0') then return 0 end
redis.call('SET', seqkey, seq)
local i = 6
while i <= #ARGV do
  local op, n = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if op == 'S' then
    for j = i, i + n - 1 do
      redis.call('SADD', prefix .. 'b:' .. ARGV[j], member)
      redis.call('SADD', held, ARGV[j])
    end
  elseif op == 'R' then
    for j = i, i + n - 1 do
      redis.call('SREM', prefix .. 'b:' .. ARGV[j], member)
      redis.call('SREM', held, ARGV[j])
    end
  elseif op == 'C' then
    for _, h in ipairs(redis.call('SMEMBERS', held)) do
      redis.call('SREM', prefix .. 'b:' .. h, member)
    end
    redis.call('DEL', held)
  end
  i = i + n
end
return 1
"""

_PURGE = """
local prefix, member, held, seqkey = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
for _, h in ipairs(redis.call('SMEMBERS', held)) do
  redis.call('SREM', prefix .. 'b:' .. h, member)
end
redis.call('DEL', held, seqkey)
return 1
"""


class RedisDirectory:
    def __init__(self, url: str, prefix: str = "baton:", timeout_s: float = 0.25):
        self.prefix = prefix
        self.redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
        )  # fmt: skip
        self._apply = self.redis.register_script(_APPLY)
        self._purge = self.redis.register_script(_PURGE)

    def _keys(self, worker: WorkerId, incarnation: str) -> list[str]:
        member = f"{incarnation}:{worker}"
        return [
            self.prefix, member, f"{self.prefix}h:{member}", f"{self.prefix}s:{member}",
        ]  # fmt: skip

    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None:
        args: list[str | int] = [*self._keys(worker, incarnation), batch.seq]
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                op = "S" if isinstance(event, BlockStored) else "R"
                args += [op, len(event.block_hashes), *(h.hex() for h in event.block_hashes)]
            elif isinstance(event, AllBlocksCleared):
                args += ["C", 0]
        try:
            await self._apply(args=args)
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, int]:
        matched = dict.fromkeys(live, 0)
        if not hashes or not live:
            return matched
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.smembers(f"{self.prefix}b:{h.hex()}")
                holders = await pipe.execute()
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e
        alive = {f"{inc}:{w}".encode(): w for w, inc in live.items()}
        remaining = set(alive)
        for members in holders:
            remaining &= members
            if not remaining:
                break
            for m in remaining:
                matched[alive[m]] += 1
        return matched

    async def forget(self, worker: WorkerId, incarnation: str) -> None:
        try:
            await self._purge(args=self._keys(worker, incarnation))
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e

    async def num_blocks(self, worker: WorkerId, incarnation: str) -> int:
        try:
            return int(await self.redis.scard(self._keys(worker, incarnation)[2]))
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e

    async def ping(self) -> None:
        try:
            await self.redis.ping()
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e

    async def close(self) -> None:
        await self.redis.aclose()
