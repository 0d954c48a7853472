"""Several async streams read as one (the replica's choices of a request, the ingress's calls of a
streamed request)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

T = TypeVar("T")


async def merged(streams: Iterable[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, each with its iterator's index. The first
    failure is raised; closing this iterator (or a failure) closes every stream still open."""
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None, False))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, None, e, True))
            return
        await queue.put((i, None, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                open_streams -= 1
            else:
                yield i, item  # type: ignore[misc]  # not done: an item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
