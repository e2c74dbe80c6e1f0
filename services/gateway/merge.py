"""Items of several async iterators as they come (the ``n`` choices of one request)."""

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def merge(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the source's index. One
    source is iterated directly (no task, no queue: the common n = 1 path stays lean); an
    error in any source is raised here, and leaving early cancels every source."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, src: AsyncIterator[T]) -> None:
        try:
            async for item in src:
                queue.put_nowait((i, item))
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
