"""Adapter-only weight updates of a vLLM server through vLLM's own LoRA support: the server,
started with `VLLMServerSpec.lora_rank`, serves a PEFT adapter directory under a model name that
generation requests name (`VLLMAdapter(model=name)`), and each update loads the next version's
directory under that same name (docs/engines.md, "LoRA")."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from tandem.fleet.adapters import vllm_load_adapter
from tandem.weights.report import WeightSyncError


def load_adapter(url: str, name: str, path: str | os.PathLike[str], *, api_key: str | None = None,
                 timeout_s: float = 60.0) -> None:
    """Make the vLLM server at `url` serve the PEFT adapter in directory `path`
    (`adapter_config.json`, `adapter_model.safetensors`) under the model name `name`, replacing the
    adapter `name` served; return once requests for `name` run on it.

    `path` must be a directory no earlier load used: vLLM's prefix cache keys an adapter's KV
    blocks by (name, path), so changed files at a path loaded before are served with the old
    weights' KV for cached prefixes (measured, vLLM 0.32). A failed load (no adapter there, a rank
    above the server's) raises WeightSyncError (phase "load_adapter") and leaves `name` serving
    what it served. Requests already running are not paused: pause the server around the load and
    set the version after it, as for a full update."""
    call = vllm_load_adapter(name, os.path.abspath(path))  # the server resolves it, from its own cwd
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"  # /v1 routes are behind vLLM's API key
    request = urllib.request.Request(url.rstrip("/") + call.path, json.dumps(call.body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise WeightSyncError(f"vLLM at {url} did not load adapter {name!r} from {path}: HTTP {exc.code}: "
                              f"{_error_message(exc.read())}", "load_adapter") from None
    except (urllib.error.URLError, OSError) as exc:
        raise WeightSyncError(f"vLLM at {url} did not load adapter {name!r} from {path}: {exc}",
                              "load_adapter") from exc


def _error_message(body: bytes) -> str:
    """vLLM's {"error": {"message": ...}} (404 without LoRA routes: {"detail": ...}), else the text."""
    try:
        data = json.loads(body)
        error = data.get("error", data.get("detail", data))
        return str(error.get("message", error) if isinstance(error, dict) else error)[:500]
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:500]
