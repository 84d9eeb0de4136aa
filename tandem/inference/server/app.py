"""The FastAPI app (routes, auth, error handlers, engine lifecycle) and `serve`, which runs it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

from tandem.http_auth import BearerAuth
from tandem.inference.server import (
    classify_routes,
    faults,
    generate_route,
    memory_routes,
    openai_routes,
    routes,
)
from tandem.inference.server.args import ServerArgs
from tandem.inference.server.engine_loop import EngineLoop
from tandem.inference.server.http_api import ApiError, ControlError, control_response, error_response
from tandem.inference.server.join import EXIT_JOIN_FAILED, prepare_join, register_when_ready
from tandem.inference.server.state import ServerState
from tandem.inference.server.weights import routes as weight_routes
from tandem.net import is_loopback
from tandem.openai_compat import OpenAIRequestError

log = logging.getLogger("tandem.serve")
OPEN_PATHS = {"/health"}  # answered without the API key


def build_app(args: ServerArgs) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop = EngineLoop(args, asyncio.get_running_loop())
        app.state.tandem = ServerState(args, engine_loop, injector)
        engine_loop.start()
        joining = None
        if args.join is not None:
            joining = asyncio.create_task(register_when_ready(args, prepare_join(args), engine_loop.ready))
        try:
            yield
        finally:
            if joining is not None:
                joining.cancel()
            app.state.tandem.weights.close()
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="tandem serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    for r in (routes.router, generate_route.router, weight_routes.router, memory_routes.router, openai_routes.router,
              classify_routes.router):
        app.include_router(r)
    injector = faults.install(app)  # tests only: None unless TANDEM_FAULT_INJECTION=1

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(OpenAIRequestError)
    async def _openai_error(request: Request, exc: OpenAIRequestError) -> JSONResponse:
        return error_response(exc.message, exc.status)

    @app.exception_handler(ControlError)
    async def _control_error(request: Request, exc: ControlError) -> JSONResponse:
        return control_response(False, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # A bug: answered in the error format (not starlette's plain text); uvicorn logs the traceback.
        return error_response(f"internal error on {request.method} {request.url.path} ({type(exc).__name__}: "
                              f"{exc}); see the server log", 500)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(f"no route {request.method} {request.url.path}", 404)

    if args.api_key:
        denied = error_response("missing or wrong API key; send 'Authorization: Bearer <key>'", 401)
        app.add_middleware(BearerAuth, token=args.api_key, denied=denied, open_paths=OPEN_PATHS)
    return app


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The startup warning for a server other machines may reach without a key, else None."""
    if api_key or is_loopback(host):
        return None
    return (f"tandem serve: warning: listening on {host} (not a loopback address) without --api-key: anyone who "
            "can reach this port can generate, pause or abort generation, release memory and swap the served "
            "weights. Pass --api-key KEY (clients then send 'Authorization: Bearer KEY'), or --host 127.0.0.1 to "
            "accept this machine only.")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY on a
    # transport only when `sock.proto == IPPROTO_TCP`. Without it, h11 writes a response's headers
    # and body separately and on a kept-alive connection the body waits for the client's delayed
    # ACK (Nagle): ~40 ms per call. NODELAY on the listener too (Linux copies it to accepted sockets).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(args: ServerArgs) -> int:
    """Run until SIGINT/SIGTERM (uvicorn's graceful shutdown: stop accepting, finish in-flight
    responses for up to 10 s, then stop the engine thread)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.join is not None:
        prepare_join(args)  # before anything loads: a bad run directory fails at once
    if (warning := exposure_warning(args.host, args.api_key)) is not None:
        print(warning, file=sys.stderr, flush=True)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    args.port = port
    shown = f"[{host}]" if ":" in host else host
    # Machine-readable: launchers and tests read the actual port from this line.
    print(f"tandem serve: listening on http://{shown}:{port}", flush=True)
    config = uvicorn.Config(build_app(args), log_level=args.log_level, access_log=args.log_level in ("info", "debug"),
                            timeout_graceful_shutdown=10, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    # Our own handlers (uvicorn's re-raise the signal after shutdown, so the exit code would be 143).
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
    print("tandem serve: stopped", file=sys.stderr, flush=True)
    return EXIT_JOIN_FAILED if args.join_failed else 0
