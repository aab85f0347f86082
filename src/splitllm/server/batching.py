"""Cross-session batching: steps of different sessions arriving close together share one forward pass.

A decoding step reads every weight of the middle layers to process a handful of positions, so running
the steps of many sessions together costs little more than one. The batcher waits at most `window_s`
after the first step of a batch arrives (less when every open session has already sent one), then
runs all waiting steps at once. Each batch takes everything that is waiting, so no session waits
more than one batch behind another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")


class StepBatcher(Generic[T]):
    def __init__(
        self,
        run: Callable[[list[T]], list[bytes]],
        executor: Executor,
        window_s: float,
        expected: Callable[[], int],
    ) -> None:
        self._run, self._executor, self._window_s, self._expected = run, executor, window_s, expected
        self._pending: list[tuple[T, asyncio.Future[bytes]]] = []
        self._arrived = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    @property
    def idle(self) -> bool:
        """Nothing waiting and no batch being gathered or run."""
        return not self._pending and self._flusher is None

    async def submit(self, item: T) -> bytes:
        """Queue one prepared step; resolves to its reply frame once its batch has run."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._arrived.set()
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _gather(self) -> None:
        """Wait out the window, unless every session that could send a step already has."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._window_s
        while len(self._pending) < self._expected() and (left := deadline - loop.time()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._gather()
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    replies = await loop.run_in_executor(self._executor, self._run, [item for item, _ in batch])
                except BaseException as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    raise
                for (_, future), reply in zip(batch, replies):
                    if not future.done():
                        future.set_result(reply)
        finally:
            self._flusher = None
