"""Listen while the model loads: /health answers 503 until the engine is ready, then the real
app takes over on the same socket (load balancers and readiness probes see "not ready" instead
of a refused connection, and nothing races for the port)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from typing import Any, Awaitable, Callable

from hypercorn.asyncio import serve as hypercorn_serve
from quart import Quart

from jaxserve.server.app import begin_drain, finish_background, hypercorn_config, state_of
from jaxserve.server.cors import CorsPolicy, is_preflight
from jaxserve.server.errors import BODIES, ApiError, protocol_of

log = logging.getLogger("jaxserve.server")

Scope = dict[str, Any]


class LoadingGate:
    """An ASGI app that answers 503 until `app` is set, then forwards everything to it.

    `cors`: the policy the app will serve with. It is known before the model is, so preflights are
    answered now and the 503s carry the allow headers: a browser page polling a loading server
    sees "still loading", not an opaque network error."""

    def __init__(self, cors: CorsPolicy | None = None) -> None:
        self.app: Quart | None = None
        self.cors = cors

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]) -> None:
        if self.app is not None and scope["type"] != "lifespan":
            await self.app(scope, receive, send)
        elif scope["type"] == "lifespan":
            # The real app's own start-up and shutdown run when it is swapped in and at the end.
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            headers = {k.decode("latin-1").title(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            cors = {} if self.cors is None else self.cors.response_headers(headers.get("Origin"))
            if self.cors is not None and is_preflight(scope["method"], headers):
                status, cors, text = self.cors.preflight(headers)
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"text/plain")] + _encoded(cors)})
                await send({"type": "http.response.body", "body": text.encode()})
                return
            if scope["path"] == "/health":
                body, content_type = b"", b"text/plain"
            else:
                # Each protocol's own error body, as the app answers once loaded.
                err = ApiError(503, "the model is still loading", code=503)  # type: ignore[arg-type]  # as before: 503
                body = json.dumps(BODIES[protocol_of(scope["path"])](err)).encode()
                content_type = b"application/json"
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", content_type), (b"retry-after", b"5")] + _encoded(cors)})
            await send({"type": "http.response.body", "body": body})


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def check_port(host: str, port: int) -> None:
    """OSError naming the address when host:port cannot be listened on (another server holds it):
    found before loading a model, not after minutes of it. Hypercorn binds it again at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Hypercorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise OSError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror}") from None


def serve_while_loading(load: Callable[[], Quart], host: str, port: int, shutdown_timeout: float = 30.0,
                        cors: CorsPolicy | None = CorsPolicy()) -> None:
    """Open the port at once, build the real app with `load()` in a worker thread, swap it in, and
    serve until SIGTERM/SIGINT (then drain as `app.serve` does). Blocks; re-raises load errors.
    `cors`: the policy the loaded app serves with (see LoadingGate)."""

    check_port(host, port)

    async def main() -> None:
        gate = LoadingGate(cors)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if gate.app is None and not stop.is_set():
                # Loading and compiling run in a thread nothing can interrupt, for minutes on a
                # large model: a signal now ends the process (nothing is served, nothing to drain).
                log.warning("%s while the model loads: exiting", sig.name)
                logging.shutdown()
                os._exit(128 + sig)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        failed: list[BaseException] = []

        async def trigger() -> None:
            await stop.wait()
            if gate.app is not None:
                begin_drain(state_of(gate.app), shutdown_timeout)

        server = asyncio.create_task(hypercorn_serve(gate, hypercorn_config(host, port, shutdown_timeout),
                                                     shutdown_trigger=trigger))
        log.info("listening on http://%s:%d while the model loads (/health: 503 until ready)", host, port)
        try:
            app = await asyncio.to_thread(load)
        except BaseException as e:  # a load failure ends the process after closing the port
            failed.append(e)
            stop.set()
        else:
            await app.startup()
            gate.app = app
            log.info("serving %s on http://%s:%d", state_of(app).model_name, host, port)
        await server
        if gate.app is not None:
            await finish_background(state_of(gate.app), shutdown_timeout)
            await gate.app.shutdown()
        if failed:
            raise failed[0]

    asyncio.run(main())
