"""The thread that drives a device engine for asyncio callers (AsyncEngine, AsyncClassifyEngine).

Callers on event loops send commands through a queue and wake the thread; only the thread touches
the engine. Once the thread has stopped (shutdown, or a device error) it takes no more commands: a
command sent after that is refused at once with EngineDeadError, as is every command still queued,
so no caller waits forever on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

log = logging.getLogger("jaxserve.engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a device error, or shutdown); no request can be served."""


class EngineThread:
    """Subclasses implement `_handle` (one command), `_tick` (one unit of engine work), and what
    happens to requests in flight when the loop fails (`_fail`), to commands it never ran
    (`_refuse`) and to whatever is still open when it ends (`_close`)."""

    def __init__(self, name: str):
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False  # set (under _lock) once the thread takes no more commands
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    # ---- event-loop side -------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        """Queue a command for the thread; EngineDeadError once the thread has stopped."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        with self._lock:  # a command queued after the thread's last drain would wait forever
            if self._closed:
                raise EngineDeadError("the engine shut down")
            self._commands.put(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request before the engine's next step (nothing to do once the thread stopped)."""
        with self._lock:
            if self._closed:
                return
            self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain()
                if not self._tick():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # a device failure fails every request in flight
            log.exception("%s loop failed", self._thread.name)
            self.error = e
            self._fail(EngineDeadError(f"the engine stopped: {e}"))
        finally:
            with self._lock:
                self._closed = True
            while True:
                try:
                    self._refuse(self._commands.get_nowait(), EngineDeadError("the engine shut down"))
                except queue.Empty:
                    break
            self._close()

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(command)

    def _handle(self, command: tuple) -> None:
        raise NotImplementedError

    def _tick(self) -> bool:
        """One unit of engine work; False when there was none (the thread then sleeps until woken)."""
        raise NotImplementedError

    def _fail(self, error: EngineDeadError) -> None:
        raise NotImplementedError

    def _refuse(self, command: tuple, error: EngineDeadError) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


def post(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    """Settle `future` (a result, or an exception when `value` is one) on its own event loop."""
    try:
        loop.call_soon_threadsafe(_settle, future, value)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody waits for this result any more


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
