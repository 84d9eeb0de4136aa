"""`RUN_DIR/controller.json`: how servers and tools outside a run reach its controller.

    {"address": "http://127.0.0.1:PORT", "token": "...", "api_key": "..." or null, "pid": 1234}

`tandem train` writes it (mode 0600 from creation, replaced atomically) once its controller is up
and removes it when the run ends; the token grants joining and reading the membership only.
`ControllerClient` is what `tandem serve --join` and `tandem fleet` use. See docs/fleet.md,
"Joining a running run"."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.errors import TandemError

CONTROLLER_FILE = "controller.json"


class ControllerFileError(TandemError):
    """controller.json is missing or malformed, or the controller it names cannot be reached."""


@dataclass(frozen=True)
class ControllerFile:
    address: str
    token: str
    api_key: str | None
    pid: int


def write_controller_file(run_dir: str | Path, info: ControllerFile) -> Path:
    path = Path(run_dir) / CONTROLLER_FILE
    tmp = path.with_name(f".{CONTROLLER_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(info), f)
    os.replace(tmp, path)
    return path


def read_controller_file(run_dir: str | Path) -> ControllerFile:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ControllerFileError(f"{run_dir} is not a directory: give the run directory of a `tandem train` run")
    path = run_dir / CONTROLLER_FILE
    try:
        data: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise ControllerFileError(
            f"{path} does not exist: is `tandem train` running with this run directory? The file appears once "
            "its rollout controller is up, and goes when the run ends") from None
    except ValueError as exc:
        raise ControllerFileError(f"{path} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ControllerFileError(f"{path} must hold a JSON object")
    for key, kind in (("address", str), ("token", str), ("pid", int)):
        if not isinstance(data.get(key), kind):
            raise ControllerFileError(f"{path}: key {key!r} is missing or not a {kind.__name__}")
    api_key = data.get("api_key")
    if api_key is not None and not isinstance(api_key, str):
        raise ControllerFileError(f"{path}: key 'api_key' must be a string or null")
    return ControllerFile(data["address"], data["token"], api_key, data["pid"])


@contextlib.contextmanager
def controller_file(run_dir: str | Path, info: ControllerFile) -> Iterator[Path]:
    """controller.json for the duration of the block."""
    path = write_controller_file(run_dir, info)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


class ControllerClient:
    """The join-token routes of a running controller (`GET /fleet/members`, `POST /fleet/join`)."""

    def __init__(self, info: ControllerFile, timeout_s: float = 5.0):
        self.info, self.timeout_s = info, timeout_s

    def members(self) -> dict[str, Any]:
        """`{"generation": int, "version": int, "servers": [{address, pid, state, version,
        in_flight, tokens_served, last_error}, ...]}`."""
        data = self._request("GET", "/fleet/members", None)
        if not isinstance(data, dict) or not isinstance(data.get("servers"), list):
            raise ControllerFileError(f"the controller at {self.info.address} answered an unexpected body: {data!r:.200}")
        return data

    def join(self, address: str, pid: int | None, devices: int = 1) -> str:
        """Register the server at `address`, spanning `devices` (its ranks in a transfer group);
        -> its state ("joining", or what it is already)."""
        data = self._request("POST", "/fleet/join", {"address": address, "pid": pid, "devices": devices})
        return str(data.get("state", "")) if isinstance(data, dict) else ""

    def _request(self, method: str, path: str, body: Any) -> Any:
        req = urllib.request.Request(
            self.info.address.rstrip("/") + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.info.token}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            if err.code == 401:
                raise ControllerFileError(
                    f"the controller at {self.info.address} refused the join token (401): controller.json is from "
                    "another run, or the run restarted; read the run directory's file again") from None
            raise ControllerFileError(f"the controller at {self.info.address} answered {err.code} to {method} "
                                      f"{path}: {err.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ControllerFileError(
                f"cannot reach the run's controller at {self.info.address} ({getattr(exc, 'reason', exc)}): the run "
                "may have ended") from None
