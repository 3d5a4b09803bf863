"""AsyncEngine: the engine loop in its own thread, requests as async iterators.

The web server's event loop never waits on the device: `submit()` hands the request to the
engine thread through a queue, and the thread posts each output delta back with
`loop.call_soon_threadsafe`. Cancelling the iterator (client gone, deadline, shutdown) aborts
the request inside the engine before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from jaxserve.engine.engine import Engine
from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import SamplingParams

log = logging.getLogger("jaxserve.engine")

_DONE = object()


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a device error); no request can be served."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side -------------------------------------------------------------------------
    async def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; iterate its output deltas. Validation errors raise here, before the
        first delta (InvalidRequestError / RequestTooLongError)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        self._commands.put(("add", request_id, prompt_ids, params, priority, loop, deltas, accepted))
        self._wake.set()
        await accepted  # raises the validation error, if any
        return self._iterate(request_id, deltas)

    async def _iterate(self, request_id: str, deltas: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await deltas.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._post(out.request_id, out, last=out.finished)
        except BaseException as e:  # a device failure ends every stream with the error
            log.exception("engine loop failed")
            self.error = e
            for request_id in list(self._streams):
                self._post(request_id, EngineDeadError(f"the engine stopped: {e}"), last=True)
        finally:
            for request_id in list(self._streams):
                self.engine.abort(request_id)
                self._post(request_id, _DONE, last=True)
            try:
                self.engine.close()  # multi-host: the other processes stop with this one
            except Exception:
                log.exception("could not stop the other processes")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, prompt_ids, params, priority, loop, deltas, accepted = cmd
                try:
                    self.engine.add_request(request_id, prompt_ids, params, priority)
                except Exception as e:  # validation errors go back to the caller
                    loop.call_soon_threadsafe(_resolve, accepted, e)
                    continue
                self._streams[request_id] = (loop, deltas)
                loop.call_soon_threadsafe(_resolve, accepted, None)
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._post(cmd[1], out, last=True)

    def _post(self, request_id: str, item: object, last: bool) -> None:
        stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is None:
            return
        loop, deltas = stream
        try:
            loop.call_soon_threadsafe(deltas.put_nowait, item)
        except RuntimeError:
            # The consumer's event loop is closed: nobody will read this stream again. Drop it and
            # free the request's pages; a dead client must never stop the engine.
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
