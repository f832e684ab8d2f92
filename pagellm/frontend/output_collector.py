"""`RequestOutputCollector`: where one stream's news waits for its consumer (vLLM V1's
class of the same name, made lazy).

AsyncLLM's output handler takes a whole engine step in one pass on the event loop: it
detokenizes every request's new tokens and tells each stream's collector that there is
news (`notify`), waking the consumer if it waits. The consumer builds its
`RequestOutput` when it runs (`take`, bound to the request's state): everything since
its last output (DELTA: one completion's text, token ids and logprobs since its last
output, with the next ready at once if another completion changed too; CUMULATIVE and
FINAL_ONLY: the state as it is now).

Why lazy: with 256 streams, building an output per stream per step and waking every
consumer for it cost about as much as a small model's whole step, so a frontend that
fell behind fell further behind each step (the lag grew to tens of milliseconds). Now
nothing piles up: a stream holds at most one pending notice, and a consumer that is
behind wakes once and builds one output for several steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagellm.frontend.outputs import RequestOutput


class RequestOutputCollector:
    def __init__(self, take: Callable[[], RequestOutput | None]) -> None:
        """`take` builds the output from everything since the last one (None: nothing
        to send yet, e.g. FINAL_ONLY before the end)."""
        self._take = take
        self._ready = False
        # What ends the stream (the engine died, the request failed in the engine);
        # raised once every output before it has been taken.
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def notify(self) -> None:
        """The request has news; never blocks, and costs nothing more if the consumer
        has not taken the last news yet."""
        self._ready = True
        if self._waiter is not None:
            self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (after what was delivered before it)."""
        if self._error is None:
            self._error = error
        self._wake()

    def get_nowait(self) -> RequestOutput | BaseException | None:
        """The next output, else the exception that ends the stream, else None."""
        if self._ready:
            self._ready = False
            output = self._take()
            if output is not None:
                return output
        return self._error

    async def get(self) -> RequestOutput | BaseException:
        """Wait for the next output, or the exception that ends the stream."""
        while (item := self.get_nowait()) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return item

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its consumer was cancelled
            waiter.set_result(None)
