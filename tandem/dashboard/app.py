"""`tandem dashboard RUN_DIR`: a web page of a run (running or finished), served by FastAPI.

Routes: `/` the page (`static/`), `/api/run`, `/api/metrics?since=N`, `/api/steps?since=N`,
`/api/fleet?events=N`, `/api/trajectories?step&min_reward&max_reward&staleness&offset&limit`,
`/api/trajectory?step&i`, and `/api/events`, server-sent events: `change` whenever a file the page
shows changed (polled every `poll_s`; each stream ends after `stream_s`, and the browser's
EventSource reconnects). When the run wrote a key (`dashboard/key`, read at every request), every
route wants it: as
`Authorization: Bearer KEY`, or the cookie `GET /?key=KEY` sets (the URL `tandem dashboard`
prints). See docs/dashboard.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from tandem.dashboard.store import RunStore

STATIC = Path(__file__).with_name("static")
COOKIE = "tandem_dashboard_key"
DENIED = ("this run's dashboard needs its key: open the URL `tandem dashboard RUN_DIR` prints "
          "(the key is in RUN_DIR/dashboard/key)")


def create_app(store: RunStore, *, poll_s: float = 0.5, stream_s: float = 300.0) -> FastAPI:
    app = FastAPI(title="tandem dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        key = store.key()  # read each time: a run that just started writes it after the page started
        if key is None:
            return await call_next(request)
        given = request.headers.get("authorization", "")
        ok = hmac.compare_digest(given.encode(), f"Bearer {key}".encode()) or hmac.compare_digest(
            request.cookies.get(COOKIE, "").encode(), key.encode())
        if request.url.path == "/" and "key" in request.query_params:
            if not hmac.compare_digest(request.query_params["key"].encode(), key.encode()):
                return JSONResponse({"error": "a wrong key: " + DENIED}, status_code=401)
            redirect = RedirectResponse("/", status_code=303)  # the key leaves the address bar
            redirect.set_cookie(COOKIE, key, httponly=True, samesite="strict")
            return redirect
        if not ok:
            return JSONResponse({"error": DENIED}, status_code=401)
        return await call_next(request)

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/static/{name}")
    def static(name: str) -> FileResponse:
        path = STATIC / name
        if not path.is_file():  # `{name}` matches no "/": only the folder's own files
            raise HTTPException(404, f"no static file {name!r}")
        return FileResponse(path)

    @app.get("/api/run")
    def run() -> dict:
        return store.run()

    @app.get("/api/metrics")
    def metrics(since: int = Query(0, ge=0)) -> Response:
        rows, total = store.metrics(since)
        return _json({"rows": rows, "total": total})

    @app.get("/api/steps")
    def steps(since: int = Query(0, ge=0)) -> Response:
        rows, total = store.steps(since)
        return _json({"rows": rows, "total": total})

    @app.get("/api/fleet")
    def fleet(events: int = Query(500, ge=0, le=100_000)) -> Response:
        return _json(store.fleet(events))

    @app.get("/api/trajectories")
    def trajectories(step: int | None = None, min_reward: float | None = None, max_reward: float | None = None,
                     staleness: int | None = None, offset: int = Query(0, ge=0),
                     limit: int = Query(100, ge=1, le=1000)) -> Response:
        return _json(store.trajectories(step=step, min_reward=min_reward, max_reward=max_reward,
                                        staleness=staleness, offset=offset, limit=limit))

    @app.get("/api/trajectory")
    def trajectory(step: int, i: int) -> Response:
        try:
            return _json(store.trajectory(step, i))
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None

    @app.get("/api/events")
    async def events(request: Request) -> StreamingResponse:
        async def stream():
            last, ends = None, time.monotonic() + stream_s
            yield "retry: 1000\n\n"
            while time.monotonic() < ends and not await request.is_disconnected():
                now = await asyncio.to_thread(store.changed)
                if now != last:
                    last = now
                    yield f"event: change\ndata: {json.dumps({'time': time.time()})}\n\n"
                # The run is another process writing files: their sizes and times are the only
                # signal there is (no inotify dependency); a poll stats five files.
                await asyncio.sleep(poll_s)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    return app


def _json(body: object) -> Response:
    # JSON without NaN (metrics.jsonl already writes None for it), compact: 1,000 steps stay small.
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8265) -> None:
    """Serve `run_dir`'s dashboard until interrupted; prints the URL to open (with the key, if any)."""
    import uvicorn

    store = RunStore(run_dir)
    key = store.key()
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?key={key}" if key else "")
    print(f"tandem dashboard: {store.run_dir} at {url}", flush=True)
    uvicorn.run(create_app(store), host=host, port=port, log_level="warning")
