"""AsyncEngine: the engine loop in its own thread, requests as async iterators.

The web server's event loop never waits on the device: `submit()` hands the request to the
engine thread through a queue, and the thread posts each output delta back with
`loop.call_soon_threadsafe`. Cancelling the iterator (client gone, deadline, shutdown) aborts
the request inside the engine before its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import AsyncIterator

from jaxserve.engine.core import Engine
from jaxserve.engine.embeds import EmbedSpan, ImageItem
from jaxserve.engine.info import EngineInfo, Stats
from jaxserve.engine.engine_thread import EngineDeadError, EngineThread, log, post
from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError"]

_DONE = object()


class AsyncEngine(EngineThread):
    def __init__(self, engine: Engine):
        super().__init__("jaxserve-engine")
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._start()

    # ---- event-loop side -------------------------------------------------------------------------
    async def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
        images: Sequence[ImageItem] = (), embeds: Sequence[EmbedSpan] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; iterate its output deltas. Validation errors raise here, before the
        first delta (InvalidRequestError / RequestTooLongError); EngineDeadError once the engine
        thread has stopped. images / embeds: Engine.add_request's (the images are encoded on the
        engine thread, which owns the device)."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        inputs = {"images": images, "embeds": embeds} if images or embeds else {}
        self._send(("add", request_id, prompt_ids, params, priority, loop, deltas, accepted, inputs))
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

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def stats(self) -> Stats:
        """The engine's latest snapshot (published by the engine thread after every step)."""
        return self.engine.stats

    def abort_by_rid(self, rid: str) -> None:
        """SGLang's /abort_request: the request named `rid`, or, where no request is, sample i of
        the request of n samples whose samples SGLang names `<id>_<i>` (the others run on)."""
        with self._lock:  # as abort: nothing to do once the thread stopped
            if self._closed:
                return
            self._commands.put(("abort_rid", rid))
        self._wake.set()

    def abort_all(self) -> None:
        """End every request now (they finish with finish_reason "abort")."""
        with self._lock:
            if self._closed:
                return
            self._commands.put(("abort_all",))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's unused pages (Engine.reset_prefix_cache) between two steps."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(("reset_prefix_cache", loop, done))
        return await done

    async def load_lora(self, name: str, path: str, replace: bool = False, pinned: bool = False) -> None:
        """Load a LoRA adapter (Engine.add_lora): its files are read on a worker thread, and only
        the bookkeeping (and a write into a slot) waits for the engine thread, between two steps.
        Raises LoraRefused or WeightsError (ValueErrors)."""
        adapter = await asyncio.to_thread(self.engine.read_lora, name, path)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(("lora", "add", (adapter, path, replace, pinned), loop, done))
        await done

    async def unload_lora(self, name: str) -> None:
        """Unload a LoRA adapter (Engine.unload_lora) between two steps; raises its ValueError."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(("lora", "unload", (name,), loop, done))
        await done

    # ---- engine thread ---------------------------------------------------------------------------
    def _tick(self) -> bool:
        if not self.engine.has_unfinished():
            return False
        for out in self.engine.step():
            self._post(out.request_id, out, last=out.finished)
        return True

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt_ids, params, priority, loop, deltas, accepted, inputs = command
            try:
                self.engine.add_request(request_id, prompt_ids, params, priority, **inputs)
            except Exception as e:  # validation errors go back to the caller
                post(loop, accepted, e)
                return
            self._streams[request_id] = (loop, deltas)
            post(loop, accepted, None)
        elif command[0] == "abort":
            out = self.engine.abort(command[1])
            if out is not None:
                self._post(command[1], out, last=True)
        elif command[0] == "abort_rid":
            rid = command[1]
            out = self.engine.abort(rid)
            if out is None:
                base, _, index = rid.rpartition("_")
                # ASCII digits only: str.isdigit takes "²", which int() refuses (and an exception
                # here would end the engine thread); nine at most, as no request has more samples.
                sample = base and index.isascii() and index.isdigit() and len(index) <= 9
                out = self.engine.abort_sample(base, int(index)) if sample else None
                rid = base
            if out is not None:
                self._post(rid, out, last=out.finished)
        elif command[0] == "abort_all":
            for out in self.engine.abort_all():
                self._post(out.request_id, out, last=True)
        elif command[0] == "reset_prefix_cache":
            _, loop, done = command
            post(loop, done, self.engine.reset_prefix_cache())
        elif command[0] == "lora":
            _, action, args, loop, done = command
            try:
                (self.engine.add_lora if action == "add" else self.engine.unload_lora)(*args)
            except Exception as e:  # a refusal or unreadable files: the caller's error, and the slot stays free
                post(loop, done, e)
                return
            post(loop, done, None)

    def _fail(self, error: EngineDeadError) -> None:
        for request_id in list(self._streams):
            self._post(request_id, error, last=True)

    def _refuse(self, command: tuple, error: EngineDeadError) -> None:
        if command[0] == "add":
            post(command[5], command[7], error)
        elif command[0] == "reset_prefix_cache":
            post(command[1], command[2], error)
        elif command[0] == "lora":
            post(command[3], command[4], error)

    def _close(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._post(request_id, _DONE, last=True)
        try:
            self.engine.close()  # multi-host: the other processes stop with this one
        except Exception:
            log.exception("could not stop the other processes")

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
