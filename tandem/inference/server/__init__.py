"""`tandem serve`: the inference engine behind SGLang's HTTP protocol (plus OpenAI routes).

Modules: `args` (command line), `engine_loop` (the one thread that owns the engine, bridged to
asyncio), `http_api` (request parsing, response shapes, errors), `routes` (generation and control),
`openai_routes`, the package `weights` (weight-update routes, requests, receiver, staging, the
directories disk updates may read), `faults` (fault injection, tests only), `memory_routes`
(memory release; engine side in `memory`), `app` (FastAPI app, auth, uvicorn). See
docs/inference.md, "HTTP server".
"""

from tandem.inference.server.app import build_app, serve
from tandem.inference.server.args import ServerArgs

__all__ = ["ServerArgs", "build_app", "serve"]
