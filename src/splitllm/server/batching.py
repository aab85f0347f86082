"""Cross-session batching: steps of different sessions arriving close together share one forward pass.

A decoding step reads every weight of the middle layers to process a handful of positions, so running
the steps of many sessions together costs little more than one. The batcher waits at most `window_s`
after the first step of a batch arrives (less when every open session has already sent one), then
runs the waiting steps in forwards bounded in rows and in estimated bytes. Each forward is filled
fairly: principals take turns, one step each, the least recently served first. A step with parts
left (a long prompt run a slice at a time: `run` answers None for it) goes back to the end of the
queue, so its slices alternate with everyone else's small steps instead of holding them up.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")
_Entry = tuple[T, "asyncio.Future[bytes]"]


class StepBatcher(Generic[T]):
    """`owner(item)`: whose step it is; `cost(item)`: its (rows, bytes). A step bigger than a cap runs alone.

    `run` answers a reply per item, or None for an item to be queued again (its next part).
    """

    def __init__(
        self,
        run: Callable[[list[T]], list[bytes | None]],
        executor: Executor,
        window_s: float,
        expected: Callable[[], int],
        owner: Callable[[T], str] = lambda _: "",
        cost: Callable[[T], tuple[int, int]] = lambda _: (1, 0),
        max_rows: int = 1 << 30,
        max_bytes: int = 1 << 62,
    ) -> None:
        self._run, self._executor, self._window_s, self._expected = run, executor, window_s, expected
        self._owner, self._cost, self._max_rows, self._max_bytes = owner, cost, max_rows, max_bytes
        self._pending: list[_Entry] = []
        self._arrived = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._turns = itertools.count(1)
        self._served: dict[str, int] = {}  # principal -> turn it was last served (bounded by principals)

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

    def _next_batch(self) -> list[_Entry]:
        """Waiting steps for one forward: principals in turn, one step each, until a cap is reached."""
        queues: dict[str, deque[_Entry]] = {}
        for entry in self._pending:
            queues.setdefault(self._owner(entry[0]), deque()).append(entry)
        order = sorted(queues, key=lambda principal: self._served.get(principal, 0))
        batch: list[_Entry] = []
        rows = nbytes = 0
        progressed = True
        while progressed:
            progressed = False
            for principal in order:
                queue = queues[principal]
                if not queue:
                    continue
                r, b = self._cost(queue[0][0])
                if batch and (rows + r > self._max_rows or nbytes + b > self._max_bytes):
                    continue
                batch.append(queue.popleft())
                rows, nbytes, progressed = rows + r, nbytes + b, True
        turn = next(self._turns)
        for item, _ in batch:
            self._served[self._owner(item)] = turn
        taken = {id(entry) for entry in batch}
        self._pending = [entry for entry in self._pending if id(entry) not in taken]
        return batch

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._gather()
            while self._pending:
                batch = self._next_batch()
                try:
                    replies = await loop.run_in_executor(self._executor, self._run, [item for item, _ in batch])
                except BaseException as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    raise
                for entry, reply in zip(batch, replies):
                    if reply is None:
                        self._pending.append(entry)  # its next part: behind everyone waiting now
                    elif not entry[1].done():
                        entry[1].set_result(reply)
        finally:
            self._flusher = None
