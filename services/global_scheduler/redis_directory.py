"""``RedisDirectory``: the prefix directory in Redis, shared by every scheduler replica, so the
replicas hold no routing state of their own.

Keys (``prefix`` defaults to ``baton:``; hashes in hex)::

    {prefix}b:{hash}             SET of "{incarnation}:{worker}" that hold the block
    {prefix}h:{incarnation}:{w}  SET of the hashes that incarnation holds (for clear/purge)
    {prefix}s:{incarnation}:{w}  the last applied KV-event batch seq of that incarnation
    {prefix}p:{hash}             ZSET of pending "{incarnation}:{worker}", scored by expiry
    {prefix}ph:{incarnation}:{w} SET of the hashes pending on that incarnation

A batch is applied by one Lua script (atomic, and skipped when its seq is not new, so replicas
that all receive a worker's events apply each batch once); a stored or removed block drops
that worker's pending entry for it. Pending entries are recorded by one script call per route
(members are added, never replaced: two replicas that route one prefix at once to two workers
leave both named), scored by the recording scheduler's wall clock plus the TTL, and the keys
expire in Redis a second after that. A lookup is one pipelined round trip of SMEMBERS and
ZRANGEBYSCORE (unexpired pending) per block; members of incarnations that are not live never
count. ``forget`` purges an
incarnation's entries (the server calls it off the routing path). Every call has a short
timeout and one retry, on a fresh connection, when the connection it took turned out closed
(one that went stale while Redis was away); when Redis is down the caller learns it at once
(``DirectoryUnavailable``) and routes on load alone. Keys are computed inside the scripts, so
this targets a single Redis (or a primary with replicas), not Redis Cluster.
"""

import math
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from services.global_scheduler.directory import DirectoryUnavailable, Match, count_prefixes
from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_UNPEND_ALL = """
local function unpend_all(prefix, member)
  local pend = prefix .. 'ph:' .. member
  for _, h in ipairs(redis.call('SMEMBERS', pend)) do
    redis.call('ZREM', prefix .. 'p:' .. h, member)
  end
  redis.call('DEL', pend)
end
"""

_APPLY = (
    _UNPEND_ALL
    + """
local prefix, member, held, seqkey = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local pend = prefix .. 'ph:' .. member
local seq = tonumber(ARGV[5])
if seq <= tonumber(redis.call('GET', seqkey) or '0') then return 0 end
redis.call('SET', seqkey, seq)
local i = 6
while i <= #ARGV do
  local op, n = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if op == 'S' or op == 'R' then
    local set = op == 'S' and 'SADD' or 'SREM'
    for j = i, i + n - 1 do
      redis.call(set, prefix .. 'b:' .. ARGV[j], member)
      redis.call(set, held, ARGV[j])
      redis.call('ZREM', prefix .. 'p:' .. ARGV[j], member)  -- confirmed, or gone
      redis.call('SREM', pend, ARGV[j])
    end
  elseif op == 'C' then
    for _, h in ipairs(redis.call('SMEMBERS', held)) do
      redis.call('SREM', prefix .. 'b:' .. h, member)
    end
    redis.call('DEL', held)
    unpend_all(prefix, member)
  end
  i = i + n
end
return 1
"""
)

_PURGE = (
    _UNPEND_ALL
    + """
local prefix, member, held, seqkey = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
for _, h in ipairs(redis.call('SMEMBERS', held)) do
  redis.call('SREM', prefix .. 'b:' .. h, member)
end
redis.call('DEL', held, seqkey)
unpend_all(prefix, member)
return 1
"""
)

# ARGV: prefix, now, expiry, key TTL (s), number of members, members..., hashes...
_PEND = """
local prefix, now, expiry, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local nm = tonumber(ARGV[5])
for i = 6 + nm, #ARGV do
  local key = prefix .. 'p:' .. ARGV[i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  for m = 6, 5 + nm do redis.call('ZADD', key, expiry, ARGV[m]) end
  redis.call('EXPIRE', key, ttl)
end
for m = 6, 5 + nm do
  local pend = prefix .. 'ph:' .. ARGV[m]
  for i = 6 + nm, #ARGV do redis.call('SADD', pend, ARGV[i]) end
  redis.call('EXPIRE', pend, ttl)
end
return 1
"""


class RedisDirectory:
    def __init__(
        self,
        url: str,
        prefix: str = "baton:",
        timeout_s: float = 0.25,
        clock: Callable[[], float] = time.time,
    ):
        self.prefix = prefix
        self.clock = clock  # pending entries' expiry: wall clock, comparable across replicas
        self.redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            # a pooled connection that went stale while Redis was away fails once, on a
            # closed socket: that call is retried once on a fresh one; a timeout is not
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            retry_on_timeout=False,
        )  # fmt: skip
        self._apply = self.redis.register_script(_APPLY)
        self._purge = self.redis.register_script(_PURGE)
        self._pend = self.redis.register_script(_PEND)

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

    async def record_pending(
        self, holders: list[tuple[WorkerId, str]], hashes: list[BlockHash], ttl_s: float
    ) -> None:
        if not holders or not hashes:
            return
        now = self.clock()
        members = [f"{inc}:{w}" for w, inc in holders]
        key_ttl_s = math.ceil(ttl_s) + 1  # the keys outlive every entry in them
        args: list[str | int] = [
            self.prefix, repr(now), repr(now + ttl_s), key_ttl_s, len(members), *members,
            *(h.hex() for h in hashes),
        ]  # fmt: skip
        try:
            await self._pend(args=args)
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, Match]:
        if not hashes or not live:
            return dict.fromkeys(live, Match())
        now = f"({self.clock()!r}"  # expiry strictly later than now
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.smembers(f"{self.prefix}b:{h.hex()}")
                    pipe.zrangebyscore(f"{self.prefix}p:{h.hex()}", now, "+inf")
                replies = await pipe.execute()
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(str(e)) from e
        blocks = [
            ({m.decode() for m in replies[i]}, {m.decode() for m in replies[i + 1]})
            for i in range(0, len(replies), 2)
        ]
        return count_prefixes(live, blocks)

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
