"""`BearerAuth`: the bearer-token check in front of tandem's HTTP apps (`tandem serve`, the rollout
controller's callback server). A pure ASGI middleware, so streaming and disconnect detection stay
intact. Imports the standard library and starlette only, so every room may use it.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send


class BearerAuth:
    """Every HTTP request needs `Authorization: Bearer <token>`, except on `open_paths` (no check);
    a path in `also` accepts `Bearer <its token>` as well. Tokens are compared in constant time,
    every one a path accepts being compared. A refused request is answered `denied` (its 401)."""

    def __init__(self, app: ASGIApp, token: str, denied: Response, *, open_paths: Iterable[str] = (),
                 also: Mapping[str, str] | None = None):
        self.app, self.expected, self.denied = app, _header(token), denied
        self.open_paths = frozenset(open_paths)
        self.also = {path: _header(t) for path, t in (also or {}).items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            ok = hmac.compare_digest(given, self.expected)
            if (extra := self.also.get(scope["path"])) is not None:
                ok = hmac.compare_digest(given, extra) or ok
            if not ok:
                await self.denied(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(token: str) -> bytes:
    return f"Bearer {token}".encode()
