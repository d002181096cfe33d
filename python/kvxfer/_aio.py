"""asyncio for kvxfer transfers: `await transfer`.

Each event loop gets one `CompletionQueue` whose descriptor the loop
watches (`add_reader`); a transfer awaited is watched on it with a token
naming its future, which the loop resolves when the queue reports the
outcome. The completion itself wakes the loop: no polling, no thread.
"""

import asyncio
import weakref

from ._kvxfer import CompletionQueue


class _LoopWaiter:
    """The futures of one loop's awaited transfers, by token."""

    def __init__(self, loop):
        self.loop = loop
        self.cq = CompletionQueue()
        self.futures = {}
        self.next = 0
        loop.add_reader(self.cq.fileno(), self._ready)

    def _ready(self):
        for token, err in self.cq.take():
            fut = self.futures.pop(token, None)
            if fut is None or fut.done():
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)

    def wait(self, transfer):
        fut = self.loop.create_future()
        self.next += 1
        self.futures[self.next] = fut
        self.cq.watch(transfer, self.next)
        return fut


_waiters = weakref.WeakKeyDictionary()


async def wait(transfer):
    """Resumes once `transfer` finished; raises its error."""
    loop = asyncio.get_running_loop()
    w = _waiters.get(loop)
    if w is None:
        w = _waiters[loop] = _LoopWaiter(loop)
    await w.wait(transfer)
