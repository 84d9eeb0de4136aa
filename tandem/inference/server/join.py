"""`tandem serve --join RUN_DIR`: a server that adds itself to a running `tandem train`.

Before the model loads, `prepare_join` reads `RUN_DIR/controller.json` (failing at once with a
clear message when it cannot), takes the run's API key unless one was given, and allows disk
loads from `RUN_DIR/weights` (where joiners are warmed from). Once the engine is ready,
`register_when_ready` asks the controller to take it (`POST /fleet/join` with the join token), a
bounded number of times; if the controller never accepts, the server stops with exit status 3 (it
would otherwise sit unused). From there the controller decides: it probes the server, warms it to
the current weights, and admits it at the next rebuild of the update group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from tandem.fleet.run_file import ControllerClient, ControllerFile, ControllerFileError, read_controller_file
from tandem.inference.server.args import ServerArgs

logger = logging.getLogger(__name__)

JOIN_ATTEMPTS = 10
JOIN_BACKOFF_S = 3.0
EXIT_JOIN_FAILED = 3


def prepare_join(args: ServerArgs) -> ControllerFile:
    """Read the run's controller file and fill in what joining needs (raises ControllerFileError)."""
    assert args.join is not None
    info = read_controller_file(args.join)
    if args.api_key is None:
        args.api_key = info.api_key
    weights = str(Path(args.join) / "weights")
    if weights not in args.weights_dir:
        args.weights_dir.append(weights)
    return info


def own_address(args: ServerArgs) -> str:
    """This server's URL as the controller reaches it."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else "::1" if args.host == "::" else args.host
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


async def register_when_ready(args: ServerArgs, info: ControllerFile, ready) -> None:
    """Wait for the engine (`ready`, a threading.Event), then register with the controller."""
    await asyncio.to_thread(ready.wait)
    client = ControllerClient(info)
    address = own_address(args)
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        try:
            state = await asyncio.to_thread(client.join, address, os.getpid())
        except ControllerFileError as exc:
            logger.warning("joining the run at %s failed (attempt %d of %d): %s", info.address, attempt,
                           JOIN_ATTEMPTS, exc)
            await asyncio.sleep(JOIN_BACKOFF_S)
            continue
        print(f"tandem serve: joined the run at {info.address} as {address} ({state})", flush=True)
        return
    logger.error("the run's controller at %s never accepted this server; stopping", info.address)
    args.join_failed = True
    os.kill(os.getpid(), signal.SIGTERM)
