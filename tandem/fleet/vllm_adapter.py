"""The adapter of vLLM's OpenAI server (`VLLMAdapter`): generation through its tokens-in,
tokens-out route `/inference/v1/generate` (which labels every token with its weight version), the
fleet's control operations through vLLM's RL and dev routes, and, when the server runs Tandem's
worker extension (`tandem.weights.vllm_worker`), weight transfers over a group with staged commit
through `/collective_rpc` (docs/engines.md)."""

from __future__ import annotations

from typing import Any, ClassVar

from tandem.fleet import ops
from tandem.fleet.adapters import (
    Answer,
    Capabilities,
    Encoder,
    HttpCall,
    ServerAdapter,
    UnsupportedOperation,
    tensor_fields,
)
from tandem.fleet.generation import Chunk, GenerationParams, parse_version


def _rpc(method: str, **kwargs: Any) -> HttpCall:
    """A call of a worker method through vLLM's `/collective_rpc` (its dev routes: the server runs
    with VLLM_SERVER_DEV_MODE=1)."""
    return HttpCall("/collective_rpc", {"method": method, "kwargs": kwargs})


def _vllm_disk(req: ops.DiskLoad, index: int) -> HttpCall:
    # The worker's `reload_weights` reads the checkpoint at `weights_path` into the served model in place.
    return _rpc("reload_weights", weights_path=req.path)


VLLM_ROUTES: dict[str, Encoder] = {
    # mode=abort: running requests end at once with what they produced (finish_reason "abort"),
    # requests that arrive while paused wait for /resume.
    "pause_generation": lambda req, i: HttpCall("/pause?mode=abort", {}),
    "continue_generation": lambda req, i: HttpCall("/resume", {}),
    "set_version": lambda req, i: HttpCall("/update_weight_version", {"new_version": str(req.version)}),
    "load_disk": _vllm_disk,
}


def _vllm_bucket(req: ops.DistributedBucket, index: int) -> HttpCall:
    flat = {} if req.flat is None else {"offsets": list(req.flat.offsets), "nbytes": req.flat.nbytes}
    return _rpc("tandem_stage_bucket", group_name=req.group_name, **tensor_fields(req.specs), **flat)


# Servers started with Tandem's worker extension (`tandem.weights.vllm_worker`): transfers over a
# group and staged commit, through its methods.
VLLM_EXTENSION_ROUTES: dict[str, Encoder] = {
    **VLLM_ROUTES,
    "join_group": lambda req, i: _rpc("tandem_join_group", master_address=req.master_address,
                                      master_port=req.master_port, rank_offset=1 + i, world_size=req.world_size,
                                      group_name=req.group_name, backend=req.backend, timeout_s=req.timeout_s),
    "leave_group": lambda req, i: _rpc("tandem_leave_group", group_name=req.group_name),
    "stage_distributed": _vllm_bucket,
    "load_disk": lambda req, i: _vllm_disk(req, i) if req.commit else _rpc("tandem_stage_disk", path=req.path),
    "commit": lambda req, i: _rpc("tandem_commit"),
    "discard": lambda req, i: _rpc("tandem_discard"),
}


class VLLMAdapter(ServerAdapter):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), started with
    `--logprobs-mode processed_logprobs` (logprobs of the temperature-scaled distribution),
    `--enable-scale-out` (the generate route) and, for the fleet routes (`/pause`, `/resume`,
    `/update_weight_version`, `/collective_rpc`), VLLM_SERVER_DEV_MODE=1 (docs/engines.md).

    Generation: token ids in, token ids out, each token labelled by the server with the weight
    version that sampled it (`weight_versions`: the version last set with `set_version`; tokens
    sampled before any was set are labelled "default", for which the client's version stands in,
    so set one before generating, as `tandem train` does). Tandem's
    logprob is log_softmax(logits / T) before any filtering; vLLM's processed logprobs are taken
    after top-k/top-p filtering and after min_tokens masks the stop tokens, renormalised over what
    is left, so those settings are refused (`UnsupportedOperation`) instead of reported wrongly.

    Without Tandem's worker extension, weight updates are disk loads applied on arrival: the
    weights swap at once and the version is not set (send `set_version` after it). With it
    (`extension=True`: the server was started with `--worker-extension-cls
    tandem.weights.vllm_worker.TandemWorkerExtension`, as `tandem train` starts them), updates
    over a transfer group (flat buckets) and disk updates are staged in the worker and loaded at
    the commit; `set_version` follows the commit."""

    kind = "vllm"
    capabilities = Capabilities(staged_commit=False, distributed_update=False, flat_buckets=False,
                                shared_memory=False, checksums=False, tied_head_on_disk=True,
                                commit_sets_version=False)
    routes: ClassVar[dict[str, Encoder]] = VLLM_ROUTES
    generate_path = "/inference/v1/generate"

    def __init__(self, model: str | None = None, extension: bool = False):
        self.model = model  # vLLM checks it against the served model name when given
        self.extension = extension
        if extension:
            self.capabilities = Capabilities(staged_commit=True, distributed_update=True, flat_buckets=True,
                                             shared_memory=False, checksums=False, tied_head_on_disk=True,
                                             commit_sets_version=False)
            self.routes = VLLM_EXTENSION_ROUTES

    def check(self, op: ops.FleetOp, request: Any) -> None:
        if isinstance(request, ops.DiskLoad) and not request.commit and not self.extension:
            raise UnsupportedOperation(f"vllm servers without Tandem's worker extension apply {op.name!r} on "
                                       "arrival; staged loads (commit=false) need the extension (docs/engines.md)")
        if isinstance(request, ops.DistributedBucket) and (request.commit or request.version is not None):
            raise UnsupportedOperation(f"vllm servers stage every {op.name!r} bucket (commit=false, no version), "
                                       "then load them all at the commit")
        if isinstance(request, ops.DiskLoad) and request.version is not None:
            raise UnsupportedOperation(f"vllm servers do not set a weight version with {op.name!r}; send "
                                       "set_version after it (DiskLoad.version=None)")

    def answer(self, op: ops.FleetOp, status: int, data: Any, text: str) -> Answer:
        if status != 200 and isinstance(data, dict):  # vLLM's errors: {"error": ...} or {"detail": ...}
            detail = data.get("error", data.get("detail", data.get("message", text[:300])))
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
            return Answer(False, f"HTTP {status}: {str(detail)[:300]}", None)
        if status == 200 and isinstance(data, dict) and isinstance(data.get("results"), list):
            # `/collective_rpc`: one answer per worker; the extension's are {"success", "message"}
            failed = [r for r in data["results"] if isinstance(r, dict) and r.get("success") is False]
            if failed:
                return Answer(False, "; ".join(str(r.get("message", "")) for r in failed)[:600], None)
            messages = [str(r.get("message", "")) for r in data["results"] if isinstance(r, dict)]
            return Answer(True, "; ".join(messages), ops.Acknowledged())
        return super().answer(op, status, data, text)

    def generate_body(self, rid: str, input_ids: list[int], params: GenerationParams,
                      max_new_tokens: int, return_routed_experts: bool = False) -> dict[str, Any]:
        if return_routed_experts:
            raise UnsupportedOperation("vllm servers are not mapped for routed experts; routing replay (r3) needs "
                                       "a tandem or sglang server")
        inexact = []
        if params.top_k not in (-1, 0):
            inexact.append(f"top_k={params.top_k} (use -1)")
        if params.top_p < 1.0:
            inexact.append(f"top_p={params.top_p} (use 1.0)")
        if params.min_new_tokens > 0:
            inexact.append(f"min_new_tokens={params.min_new_tokens} (use 0)")
        if inexact:
            raise UnsupportedOperation(
                f"vllm servers report logprobs renormalised after top-k/top-p filtering and min_tokens masking, "
                f"not Tandem's log_softmax(logits / T): {', '.join(inexact)} cannot be served exactly; use a "
                "tandem server for them (docs/engines.md)")
        sampling: dict[str, Any] = {
            "max_tokens": max_new_tokens, "temperature": params.temperature, "n": 1, "logprobs": 0,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos, "detokenize": False,
        }
        if params.seed is not None:
            sampling["seed"] = params.seed
        body: dict[str, Any] = {"request_id": rid, "token_ids": list(input_ids), "sampling_params": sampling,
                                "output_mode": "tokens", "stream": False}
        if self.model is not None:
            body["model"] = self.model
        return body

    def parse_generate(self, body: dict[str, Any]) -> Chunk:
        """`choices[0]`: `token_ids`, `logprobs.content[i].logprob` (the sampled token's) and
        `weight_versions` ([{version, start, end}] spans over the output tokens)."""
        choice = body["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs in a vLLM response "
                             "(was sampling_params.logprobs=0 honoured?)")
        finish = choice.get("finish_reason") or "length"
        if finish not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish reason {finish!r}")
        return Chunk(ids, logprobs, finish, None, token_versions=_token_versions(choice.get("weight_versions"), len(ids)))


def _token_versions(spans: list[dict[str, Any]] | None, count: int) -> list[int | None] | None:
    """One version per token from vLLM's spans; None when the server sent none."""
    if spans is None:
        return None
    versions: list[int | None] = []
    for span in spans:
        if span["start"] != len(versions) or span["end"] < span["start"]:
            raise ValueError(f"vLLM weight_versions spans are not contiguous from token 0: {spans}")
        versions += [parse_version(span["version"])] * (span["end"] - span["start"])
    if len(versions) != count:
        raise ValueError(f"vLLM weight_versions spans cover {len(versions)} of {count} tokens: {spans}")
    return versions
