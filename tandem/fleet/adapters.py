"""One `ServerAdapter` per kind of inference server (`tandem`, `sglang`, `vllm`): how each fleet
operation and the generate call become that server's HTTP route and body, how its answers read,
and what it can do (`Capabilities`, which the weight-update protocol consults). An operation an
adapter cannot serve raises `UnsupportedOperation` naming the server kind and the operation; it
never falls through to a wrong route. The kinds: docs/fleet.md, "Server kinds and capabilities"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.errors import TandemError
from tandem.fleet import ops
from tandem.fleet.generation import Chunk, GenerationParams, parse_version
from tandem.fleet.results import ServerChecksums


class UnsupportedOperation(TandemError, RuntimeError):
    """The server kind has no equivalent of a fleet operation (or of one of its options)."""


@dataclass(frozen=True)
class HttpCall:
    path: str
    body: dict[str, Any]
    method: str = "POST"  # GET sends no body


@dataclass(frozen=True)
class Capabilities:
    staged_commit: bool  # buckets staged, then committed or discarded as a whole
    distributed_update: bool  # weights received over a transfer group
    flat_buckets: bool  # a bucket as one broadcast of a flat buffer
    shared_memory: bool  # buckets read from /dev/shm (CUDA IPC on a GPU server)
    checksums: bool  # per-tensor checksums of the served weights
    disk_update: bool = True  # loads an HF checkpoint directory the trainer wrote
    # The update types over which the servers take LoRA adapters (merged into or served over their
    # base weights); other types move merged whole weights.
    adapter_updates: tuple[str, ...] = ()
    # A tied model's checkpoint must store its output head for a disk load (vLLM's in-place reload
    # keeps the old head otherwise; `tandem.models.tied_head`).
    tied_head_on_disk: bool = False
    # The commit sets the weight version too (tandem); else `set_version` follows it (vLLM, whose
    # version lives in its API server while the commit runs in its worker).
    commit_sets_version: bool = True
    # Staged transfers may run while the server generates (they never touch the weights it serves),
    # so an update pauses it only before the commit (tandem); else before the transfer.
    stage_while_generating: bool = False
    # The commit aborts the in-flight requests and swaps the weights between the same two engine
    # steps (tandem), so an update with nothing checked after its commit needs no pause: new
    # requests run on the old weights until the swap, and no request spans it. Else the update
    # pauses the servers around the swap.
    commit_aborts: bool = False

    def missing_for(self, update_type: str) -> str | None:
        """What these servers lack for a weight update of `update_type` (disk, distributed, shm),
        or None. Disk and distributed updates stage, then commit, where the servers offer
        `staged_commit`; elsewhere they fall back to SGLang's semantics (each call applied on
        arrival, `tandem.weights.two_phase`). Shared-memory updates always stage."""
        if update_type == "shm" and not self.staged_commit:
            return "staged transfers with commit/discard"
        if update_type == "disk" and not self.disk_update:
            return "weight updates from disk"
        if update_type == "distributed" and not self.distributed_update:
            return "weight updates over a transfer group"
        if update_type == "shm" and not self.shared_memory:
            return "shared-memory weight updates"
        return None


@dataclass(frozen=True)
class Answer:
    success: bool
    message: str
    value: Any


Encoder = Callable[[Any, int], HttpCall]  # (request, server index) -> the call


def _version(version: int | None) -> dict[str, str]:
    return {} if version is None else {"weight_version": str(version)}


def tensor_fields(specs: tuple[ops.ParamSpec, ...]) -> dict[str, Any]:
    return {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs]}


def _staging(bucket_index: int | None, commit: bool, version: int | None,
             lora_alpha: float | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"commit": commit, **(_version(version) if commit else {})}
    if bucket_index is not None:
        body["bucket_index"] = bucket_index
    if lora_alpha is not None:
        body["lora_alpha"] = lora_alpha
    return body


# -- SGLang's native protocol (both kinds) --------------------------------------------------------------
def _join_group(req: ops.JoinGroup, index: int) -> HttpCall:
    # SGLang's workers join as rank_offset + their TP rank (ModelRunner.init_weights_update_group).
    return HttpCall("/init_weights_update_group", {
        "master_address": req.master_address, "master_port": req.master_port, "rank_offset": req.rank_offset(index),
        "world_size": req.world_size, "group_name": req.group_name, "backend": req.backend})


SGLANG_ROUTES: dict[str, Encoder] = {
    "pause_generation": lambda req, i: HttpCall("/pause_generation", {"mode": "abort"}),
    "continue_generation": lambda req, i: HttpCall("/continue_generation", {}),
    "set_version": lambda req, i: HttpCall("/update_weight_version", {"new_version": str(req.version)}),
    "join_group": _join_group,
    "leave_group": lambda req, i: HttpCall("/destroy_weights_update_group", {"group_name": req.group_name}),
    "stage_distributed": lambda req, i: HttpCall("/update_weights_from_distributed", {
        **tensor_fields(req.specs), "group_name": req.group_name, "flush_cache": True, **_version(req.version)}),
    "load_disk": lambda req, i: HttpCall("/update_weights_from_disk", {"model_path": req.path,
                                                                        **_version(req.version)}),
}


# -- Tandem's extensions ------------------------------------------------------------------------------------
def _tandem_join(req: ops.JoinGroup, index: int) -> HttpCall:
    call = _join_group(req, index)
    if req.devices[index] != 1:
        raise UnsupportedOperation(f"`tandem serve` runs on one device, but join_group counts {req.devices[index]} "
                                   f"for server {index}")
    return HttpCall(call.path, {**call.body, "timeout_s": req.timeout_s})


def _tandem_distributed(req: ops.DistributedBucket, index: int) -> HttpCall:
    body = {**tensor_fields(req.specs), "group_name": req.group_name, "flush_cache": True,
            **_staging(req.bucket_index, req.commit, req.version, req.lora_alpha)}
    if req.flat is not None:
        body.update(offsets=list(req.flat.offsets), nbytes=req.flat.nbytes)
    return HttpCall("/update_weights_from_distributed", body)


def _tandem_shm(req: ops.SharedMemoryBucket, index: int) -> HttpCall:
    bucket = req.bucket
    body = {**tensor_fields(bucket.specs), "offsets": list(bucket.offsets), "nbytes": bucket.nbytes,
            "flush_cache": True, **_staging(req.bucket_index, req.commit, req.version, req.lora_alpha)}
    body.update({"segment": bucket.segment} if bucket.segment is not None else {"cuda_ipc": bucket.cuda_ipc})
    if bucket.zero_copy:
        body["zero_copy"] = True
    return HttpCall("/update_weights_from_shm", body)


TANDEM_ROUTES: dict[str, Encoder] = {
    **SGLANG_ROUTES,
    "join_group": _tandem_join,
    "stage_distributed": _tandem_distributed,
    "stage_shm": _tandem_shm,
    "load_disk": lambda req, i: HttpCall("/update_weights_from_disk", {
        "model_path": req.path, **_staging(None, req.commit, req.version)}),
    "commit": lambda req, i: HttpCall("/commit_staged_weights", {"weight_version": str(req.version),
                                                                 **({"abort_all_requests": True} if req.abort_all else {})}),
    "discard": lambda req, i: HttpCall("/discard_staged_weights", {}),
    "checksums": lambda req, i: HttpCall("/get_weights_checksum",
                                         {} if req.names is None else {"names": list(req.names)}),
}


def _checksums(data: Any) -> ServerChecksums:
    return ServerChecksums(str(data["dtype"]), {str(k): str(v) for k, v in data["checksums"].items()},
                           parse_version(data.get("weight_version")))


class ServerAdapter:
    """The routes of one server kind. Subclasses set `kind`, `capabilities` and `routes`, and the
    generate mapping."""

    kind: str
    capabilities: Capabilities
    routes: ClassVar[dict[str, Encoder]]
    generate_path: str
    # One generate call may ask for n samples of one prompt (sample i seeded `seed + i`, the prompt
    # prefilled once), answered as n items in sample order.
    samples_per_call: ClassVar[bool] = False

    def request(self, op: ops.FleetOp, request: Any, index: int) -> HttpCall:
        """The HTTP call that performs `op` with `request` on server `index` of the fleet."""
        encode = self.routes.get(op.name)
        if encode is None:
            raise UnsupportedOperation(f"{self.kind} servers have no {op.name!r} operation")
        if isinstance(request, ops.CommitStaged) and request.abort_all and not self.capabilities.commit_aborts:
            raise UnsupportedOperation(f"{self.kind} servers do not abort in-flight requests at the commit; pause "
                                       "them before it instead (CommitStaged.abort_all=False)")
        self.check(op, request)
        return encode(request, index)

    def check(self, op: ops.FleetOp, request: Any) -> None:
        """Refuse options the server kind lacks (overridden where options differ)."""

    def answer(self, op: ops.FleetOp, status: int, data: Any, text: str) -> Answer:
        ok = status == 200 and not (isinstance(data, dict) and data.get("success") is False)
        message = str(data.get("message", "")) if isinstance(data, dict) else text[:300]
        if not ok:
            return Answer(False, f"HTTP {status}: {message or text[:300]}", None)
        if op.answer is ServerChecksums:
            try:
                return Answer(True, message, _checksums(data))
            except (KeyError, TypeError, AttributeError) as exc:
                return Answer(False, f"malformed checksums answer: {type(exc).__name__}: {exc}", None)
        return Answer(True, message, ops.Acknowledged())

    def generate_body(self, rid: str, input_ids: list[int], params: GenerationParams,
                      max_new_tokens: int, return_routed_experts: bool = False, n: int = 1) -> dict[str, Any]:
        """The generate call's body; `return_routed_experts` asks for the experts each token was
        routed to (SGLang's field; UnsupportedOperation where the server kind has none); `n` > 1
        samples of the prompt in one call, where `samples_per_call`."""
        raise NotImplementedError

    def parse_generate(self, body: dict[str, Any]) -> Chunk:
        raise NotImplementedError

    def parse_samples(self, body: Any, n: int) -> list[Chunk]:
        """The `n` samples of one generate call, in sample order (`n` 1: `parse_generate`)."""
        if n == 1:
            return [self.parse_generate(body)]
        raise UnsupportedOperation(f"{self.kind} servers take one sample per generate call")

    def score_body(self, rid: str, input_ids: list[int], start: int) -> dict[str, Any]:
        """The body of a scoring call on `generate_path`: nothing generated, the logprobs of the
        sequence's own tokens from position `start` (>= 1) on, at temperature 1 (a teacher's
        distribution)."""
        raise UnsupportedOperation(f"{self.kind} servers are not mapped for scoring a sequence's own tokens "
                                   "(prompt logprobs); use tandem or sglang servers")

    def parse_score(self, body: Any, input_ids: list[int], start: int) -> list[float]:
        """The logprobs of `input_ids[start:]` from a scoring call's answer."""
        raise UnsupportedOperation(f"{self.kind} servers are not mapped for prompt logprobs")

    classify_path: str = "/classify"

    def classify_body(self, rid: str, sequences: list[list[int]]) -> dict[str, Any]:
        """The body of a classifier server's scoring call on `classify_path` for these sequences."""
        raise UnsupportedOperation(f"{self.kind} servers are not mapped for classifiers (reward models); use tandem "
                                   "or sglang servers started with --is-embedding")

    def parse_classify(self, body: Any, count: int) -> list[float]:
        """Each sequence's score (its first label's) from a classify call's answer."""
        raise UnsupportedOperation(f"{self.kind} servers are not mapped for classifiers")


class _SGLangProtocol(ServerAdapter):
    generate_path = "/generate"

    def generate_body(self, rid: str, input_ids: list[int], params: GenerationParams,
                      max_new_tokens: int, return_routed_experts: bool = False, n: int = 1) -> dict[str, Any]:
        if n > 1 and not self.samples_per_call:
            raise UnsupportedOperation(f"{self.kind} servers take one sample per generate call")
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_new_tokens": min(params.min_new_tokens, max_new_tokens),
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        if n > 1:
            sampling["n"] = n
        body = {"rid": rid, "input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True}
        if return_routed_experts:
            body["return_routed_experts"] = True
        return body

    def parse_generate(self, body: dict[str, Any]) -> Chunk:
        meta = body.get("meta_info", {})
        pairs = meta.get("output_token_logprobs") or []  # an abort while queued: [] (SGLang, tandem serve) or absent (older servers)
        if not pairs and body.get("output_ids") and meta.get("finish_reason", {}).get("type") != "abort":
            raise ValueError("server returned tokens without logprobs; was return_logprob honoured?")
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        if finish not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish reason {finish!r}")
        routed = meta.get("routed_experts")
        if routed is not None and not isinstance(routed, str):
            raise ValueError(f"meta_info.routed_experts must be a base64 string, got {type(routed).__name__}")
        return Chunk([int(p[1]) for p in pairs], [float(p[0]) for p in pairs], finish,
                     parse_version(meta.get("weight_version")), routed)

    def parse_samples(self, body: Any, n: int) -> list[Chunk]:
        if n == 1:
            return [self.parse_generate(body)]
        if not isinstance(body, list) or len(body) != n:
            raise ValueError(f"a generate call for n={n} samples must be answered by a list of {n} items, got "
                             f"{len(body) if isinstance(body, list) else type(body).__name__}")
        indices = sorted(int(item.get("index", -1)) for item in body)
        if indices != list(range(n)):
            raise ValueError(f"the {n} samples' 'index' fields are {indices}, not 0..{n - 1}")
        return [self.parse_generate(item) for item in sorted(body, key=lambda item: int(item["index"]))]

    def score_body(self, rid: str, input_ids: list[int], start: int) -> dict[str, Any]:
        if not 1 <= start < len(input_ids):
            raise ValueError(f"scoring start {start} must be in [1, {len(input_ids) - 1}]: position 0 has no logprob")
        # SGLang's prefill-only request: max_new_tokens 0 scores the prompt and generates nothing.
        return {"rid": rid, "input_ids": list(input_ids), "return_logprob": True, "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}

    def parse_score(self, body: Any, input_ids: list[int], start: int) -> list[float]:
        entries = body.get("meta_info", {}).get("input_token_logprobs") if isinstance(body, dict) else None
        want = len(input_ids) - start
        if not isinstance(entries, list) or len(entries) != want:
            got = len(entries) if isinstance(entries, list) else type(entries).__name__
            raise ValueError(f"a scoring call from position {start} of {len(input_ids)} tokens must answer "
                             f"meta_info.input_token_logprobs with {want} entries, got {got}")
        if [int(e[1]) for e in entries] != list(input_ids[start:]):
            raise ValueError("meta_info.input_token_logprobs names other tokens than the ones sent")
        if any(e[0] is None for e in entries):
            raise ValueError(f"meta_info.input_token_logprobs has a null logprob after position {start}")
        return [float(e[0]) for e in entries]

    def classify_body(self, rid: str, sequences: list[list[int]]) -> dict[str, Any]:
        return {"rid": rid, "input_ids": [list(s) for s in sequences]}  # SGLang's /classify, a batch

    def parse_classify(self, body: Any, count: int) -> list[float]:
        if not isinstance(body, list) or len(body) != count:
            got = len(body) if isinstance(body, list) else type(body).__name__
            raise ValueError(f"a /classify call for {count} sequences must answer a list of {count} items, got {got}")
        scores = []
        for item in body:
            embedding = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(embedding, list) or not embedding or not isinstance(embedding[0], int | float):
                raise ValueError(f"a /classify item must hold 'embedding': [score, ...], got {str(item)[:200]}")
            scores.append(float(embedding[0]))
        return scores


class TandemAdapter(_SGLangProtocol):
    kind = "tandem"
    samples_per_call = True
    capabilities = Capabilities(staged_commit=True, distributed_update=True, flat_buckets=True, shared_memory=True,
                                checksums=True, stage_while_generating=True, commit_aborts=True,
                                adapter_updates=("disk", "distributed", "shm"))
    routes = TANDEM_ROUTES


class SGLangAdapter(_SGLangProtocol):
    kind = "sglang"
    capabilities = Capabilities(staged_commit=False, distributed_update=True, flat_buckets=False,
                                shared_memory=False, checksums=False)
    routes = SGLANG_ROUTES

    def check(self, op: ops.FleetOp, request: Any) -> None:
        if getattr(request, "lora_alpha", None) is not None or getattr(request, "adapter", False):
            raise UnsupportedOperation("sglang servers are not mapped for LoRA adapter updates here; send merged "
                                       "weights (a tandem or vllm server takes adapters)")
        if isinstance(request, ops.DistributedBucket | ops.DiskLoad) and not request.commit:
            raise UnsupportedOperation(f"sglang servers apply {op.name!r} on arrival; staged transfers "
                                       "(commit=false) need a tandem server")
        if isinstance(request, ops.DistributedBucket) and request.flat is not None:
            raise UnsupportedOperation("sglang servers receive one broadcast per tensor; flat buckets need a "
                                       "tandem server")


# vLLM's OpenAI server: generation through `/inference/v1/generate` (every token labelled with its
# weight version), control through its RL and dev routes, weight transfers through `/collective_rpc`
# when the server runs Tandem's worker extension (`tandem.weights.vllm_worker`; docs/engines.md).

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


# The model name generation uses for the adapter of a vLLM server in LoRA mode when the run names
# none (`rollout.model`); the base is then served as `<name>-base` (`vllm_base_name`).
VLLM_LORA_NAME = "policy"


def vllm_base_name(adapter_name: str) -> str:
    """The served name of the base model under a LoRA server whose adapter is `adapter_name`:
    vLLM refuses an adapter named like a served model."""
    return f"{adapter_name}-base"


def vllm_load_adapter(name: str, path: str) -> HttpCall:
    """The call that makes a vLLM server started with LoRA (`VLLMServerSpec.lora_rank`) serve the
    PEFT adapter directory `path` under the model name `name`, replacing what that name served
    (`load_inplace`); `tandem.weights.vllm_lora.load_adapter` states the contract."""
    return HttpCall("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})


def _vllm_bucket(req: ops.DistributedBucket, index: int) -> HttpCall:
    flat = {} if req.flat is None else {"offsets": list(req.flat.offsets), "nbytes": req.flat.nbytes}
    return _rpc("tandem_stage_bucket", group_name=req.group_name, **tensor_fields(req.specs), **flat)


# Servers started with Tandem's worker extension (`tandem.weights.vllm_worker`): transfers over a
# group and staged commit, through its methods.
VLLM_EXTENSION_ROUTES: dict[str, Encoder] = {
    **VLLM_ROUTES,
    # Each worker joins as rank_offset + its rank in the server (`TandemWorkerExtension.tandem_join_group`).
    "join_group": lambda req, i: _rpc("tandem_join_group", master_address=req.master_address,
                                      master_port=req.master_port, rank_offset=req.rank_offset(i),
                                      world_size=req.world_size, devices=req.devices[i], group_name=req.group_name,
                                      backend=req.backend, timeout_s=req.timeout_s),
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
    the commit; `set_version` follows the commit.

    LoRA mode (`lora=True`: the server was started with LoRA, `VLLMServerSpec.lora_rank`, and
    serves the policy as a PEFT adapter over its base): generation requests name the adapter
    (`model`, default `VLLM_LORA_NAME`; the base must be served under another name, vLLM refuses an
    adapter named like a served model), and each update is a disk load of the adapter alone
    (`DiskLoad(adapter=True)`), loaded in place under that name through `/v1/load_lora_adapter` and
    applied on arrival: no staging, the version set after it. Whole-weight updates are refused (the
    adapter would apply on top of merged weights). The worker extension is not used."""

    kind = "vllm"
    capabilities = Capabilities(staged_commit=False, distributed_update=False, flat_buckets=False,
                                shared_memory=False, checksums=False, tied_head_on_disk=True,
                                commit_sets_version=False)
    routes: ClassVar[dict[str, Encoder]] = VLLM_ROUTES
    generate_path = "/inference/v1/generate"

    def __init__(self, model: str | None = None, extension: bool = False, lora: bool = False):
        self.model = model  # vLLM checks it against the served model name when given
        self.extension = extension
        self.lora = lora
        if lora:
            name = self.model = model or VLLM_LORA_NAME
            self.extension = False
            self.capabilities = Capabilities(staged_commit=False, distributed_update=False, flat_buckets=False,
                                             shared_memory=False, checksums=False, commit_sets_version=False,
                                             adapter_updates=("disk",))
            self.routes = {**VLLM_ROUTES, "load_disk": lambda req, i: vllm_load_adapter(name, req.path)}
        elif extension:
            self.capabilities = Capabilities(staged_commit=True, distributed_update=True, flat_buckets=True,
                                             shared_memory=False, checksums=False, tied_head_on_disk=True,
                                             commit_sets_version=False)
            self.routes = VLLM_EXTENSION_ROUTES

    def check(self, op: ops.FleetOp, request: Any) -> None:
        if self.lora:
            self._check_lora(op, request)
            return
        if getattr(request, "lora_alpha", None) is not None or getattr(request, "adapter", False):
            raise UnsupportedOperation("vllm servers take LoRA adapters through their own routes "
                                       "(tandem.weights.vllm_lora), not these weight-update ops; send merged weights")
        if isinstance(request, ops.DiskLoad) and not request.commit and not self.extension:
            raise UnsupportedOperation(f"vllm servers without Tandem's worker extension apply {op.name!r} on "
                                       "arrival; staged loads (commit=false) need the extension (docs/engines.md)")
        if isinstance(request, ops.DistributedBucket) and (request.commit or request.version is not None):
            raise UnsupportedOperation(f"vllm servers stage every {op.name!r} bucket (commit=false, no version), "
                                       "then load them all at the commit")
        if isinstance(request, ops.DiskLoad) and request.version is not None:
            raise UnsupportedOperation(f"vllm servers do not set a weight version with {op.name!r}; send "
                                       "set_version after it (DiskLoad.version=None)")

    def _check_lora(self, op: ops.FleetOp, request: Any) -> None:
        if isinstance(request, ops.DiskLoad) and not request.adapter:
            raise UnsupportedOperation(f"vllm servers in LoRA mode serve the policy as an adapter over their base: "
                                       f"{op.name!r} takes a PEFT adapter directory (DiskLoad.adapter=True), not whole "
                                       "weights, which the adapter would apply on top of")
        if isinstance(request, ops.DiskLoad) and (not request.commit or request.version is not None):
            raise UnsupportedOperation(f"vllm servers load an adapter on arrival: {op.name!r} is neither staged "
                                       "(commit=false) nor sets a version (send set_version after it)")

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
                      max_new_tokens: int, return_routed_experts: bool = False, n: int = 1) -> dict[str, Any]:
        if n > 1:
            raise UnsupportedOperation("vllm servers take one sample per generate call here")
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


SERVER_KINDS = ("tandem", "sglang", "vllm")


def adapter_for(kind: str, model: str | None = None, vllm_extension: bool = False,
                vllm_lora: bool = False) -> ServerAdapter:
    """The adapter of a server kind (`model`: the served model name a vLLM server checks;
    `vllm_extension`: vLLM servers run Tandem's worker extension; `vllm_lora`: they serve the
    policy as a LoRA adapter named `model`, `VLLMAdapter(lora=True)`)."""
    if kind == "tandem":
        return TandemAdapter()
    if kind == "sglang":
        return SGLangAdapter()
    if kind == "vllm":
        return VLLMAdapter(model, extension=vllm_extension, lora=vllm_lora)
    raise ValueError(f"unknown server kind {kind!r}; use one of {', '.join(SERVER_KINDS)}")
