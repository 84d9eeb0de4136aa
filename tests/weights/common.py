"""Helpers of the weight-sync tests: servers with fault injection, a checkpoint-backed "engine",
reference greedy decoding with the native model, and checks against what the servers hold."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tandem.fleet.ops import Deadlines
from tandem.models import load_model, save_model
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights.verify import tensor_checksum
from tests.inference.server_utils import ServerProcess, request, wait_for

PROMPTS = [[11, 57, 200, 31, 9], [300, 14, 15, 92, 65, 35, 89]]
NEW = 10
FAST = Deadlines(init_group_s=4.0, bucket_s=4.0, update_s=40.0, http_s=10.0)
BUCKET = 48 * 1024  # the tiny model (~430 KB in fp32) travels in ~10 buckets


class Versions:
    """Monotone weight versions for tests that share servers."""

    n = 0

    @classmethod
    def next(cls) -> int:
        cls.n += 1
        return cls.n


def start_server(model_dir: Path, log_dir: Path, weights_dir: Path | None = None, *args: str,
                 wait: bool = True) -> ServerProcess:
    """`tandem serve` with fault injection enabled (the hidden /_fault route) and short timeouts;
    `weights_dir`: where disk updates may come from (beside the model's directory); `args`: more
    of `tandem serve`'s arguments (`"--dtype", "bfloat16"`); `wait=False`: started, not yet ready
    (see `ServerProcess`)."""
    old = os.environ.get("TANDEM_FAULT_INJECTION")
    os.environ["TANDEM_FAULT_INJECTION"] = "1"
    extra = ("--weights-dir", str(weights_dir)) if weights_dir is not None else ()
    try:
        return ServerProcess(model_dir, log_dir, "--kv-cache-tokens", "4096", "--weight-sync-timeout", "10", *extra,
                             *args, wait=wait)
    finally:
        if old is None:
            os.environ.pop("TANDEM_FAULT_INJECTION", None)
        else:
            os.environ["TANDEM_FAULT_INJECTION"] = old


class CheckpointSource:
    """Stands in for a trainer engine: exports an HF directory's tensors, scaled by `scale` (so each
    version differs), in byte-bounded buckets; `break_shape` truncates one tensor's first dim."""

    def __init__(self, model_dir: Path, scale: float = 1.0, break_shape: str | None = None):
        self.model_dir = Path(model_dir)
        self.tensors = {n: (t.float() * scale).contiguous() for n, t in iter_hf_tensors(model_dir)}
        if break_shape is not None:
            self.tensors[break_shape] = self.tensors[break_shape][:-1].clone()

    param_dtype = None  # each tensor travels in its own dtype unless the update asks for another

    def local_weights(self) -> None:
        return None  # no trainer model: always the export

    def export_nbytes(self, dtype: torch.dtype | None) -> None:
        return None  # does not tell its size (the shm transport learns it from the first update)

    def export_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None, alloc=None, dst=None):
        bucket, size = [], 0
        for name, t in self.tensors.items():
            t = t if dtype is None else t.to(dtype)
            if bucket and size + t.numel() * t.element_size() > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket

    def save_hf(self, out_dir: Path, overwrite: bool = False, **_: Any) -> Path:
        model = load_model(self.model_dir)
        load_into(model, self.tensors)
        return save_model(model, out_dir, tokenizer_dir=self.model_dir, overwrite=overwrite)


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Copy HF-named tensors into `model` (expert pieces into their stacked parameter)."""
    adapter = model.spec.state_dict_adapter_cls(model.args)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            piece = adapter.hf_to_piece(name)
            if piece is not None:
                native, index = piece
                (params[native] if index is None else params[native][index]).copy_(t)
    return model


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full re-forward with the native (training) model: tokens and float32
    logprobs (log_softmax of the raw logits at the chosen token)."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        x = torch.tensor(ids)
        logits = model(x, torch.tensor([0, len(ids)], dtype=torch.int32))[-1].float()
        tok = int(torch.argmax(logits))
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        out.append(tok)
        ids.append(tok)
    return out, lps


def served_greedy(server: ServerProcess, prompt: list[int], n: int = NEW) -> tuple[list[int], list[float], str]:
    body = server.ok("/generate", {"input_ids": prompt, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    meta = body["meta_info"]
    return body["output_ids"], [p[0] for p in meta["output_token_logprobs"]], meta["weight_version"]


def served_checksums(server: ServerProcess) -> dict[str, str]:
    return server.ok("/get_weights_checksum", {})["checksums"]


def expected_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_checksum(t.float()) for n, t in tensors.items()}


def assert_serves(server: ServerProcess, tensors: dict[str, torch.Tensor], label: str = "") -> None:
    """Every tensor the server holds, read back whole (`/get_weights_by_name`), is `torch.equal` to
    `tensors`: an oracle independent of the product's own checksums."""
    for name, want in tensors.items():
        got = torch.tensor(server.ok("/get_weights_by_name", {"name": name, "truncate_size": want.numel()}),
                           dtype=want.dtype)
        assert got.numel() == want.numel(), (label, name, got.numel(), want.numel())
        differ = int((got != want.view(-1)).sum())
        assert torch.equal(got.view(want.shape), want), f"{label}: {name}: {differ} of {want.numel()} elements differ"


def version_of(server: ServerProcess) -> str:
    return server.ok("/get_weight_version", method="GET")["weight_version"]


def shm_leftovers() -> list[str]:
    """The weight segments this test process wrote (`tandem-w-<creator pid>-...`) that still exist:
    only its own, so that another test run beside it does not show up here."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"tandem-w-{os.getpid()}-*"))


def mapped_segments(pid: int) -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "tandem-w-" in line]


def mapped_names(pid: int) -> set[str]:
    """Names of the weight segments process `pid` maps (unlinked ones included)."""
    return {line.split("/dev/shm/", 1)[1].split()[0] for line in mapped_segments(pid)}


def served_set(servers: list[ServerProcess], timeout: float = 10.0) -> set[str]:
    """The segments the servers serve from, once the mappings a commit replaced are gone (they are
    released in the background): every server maps the same set, written by one writer (a set's
    segments share the `tandem-w-<pid>-<token>` prefix)."""

    def one_set() -> set[str] | None:
        maps = [mapped_names(s.pid) for s in servers]
        writers = {name.rsplit("-", 2)[0] for name in maps[0]}
        return maps[0] if len(writers) == 1 and all(m == maps[0] for m in maps) else None

    return wait_for(one_set, timeout=timeout, interval=0.02)


def verified_update(engine: Any, fleet: Any, meta: Any, version: int, label: str, server: ServerProcess,
                    dtype: torch.dtype | None = None) -> Any:
    """One verified update of `engine`'s weights to `fleet` as `version` (the `UpdateReport`); an
    update that fails fails the test with `label`, the error and the end of the server's log; the
    server then holds `version`."""
    import pytest

    from tandem.weights.report import WeightSyncError
    from tandem.weights.updater import WeightUpdater

    with WeightUpdater(engine, fleet, meta, verify=True, dtype=dtype) as updater:
        try:
            report = updater.update(version)
        except WeightSyncError as exc:
            pytest.fail(f"{label}: the update failed: {exc}\nserver log:\n{server.log.read_text()[-4000:]}")
    assert report.verified, label
    assert version_of(server) == str(version), label
    return report


def post_ok(url: str, path: str, body: dict) -> dict:
    """POST `body` to `url + path`; the JSON answer, asserting HTTP 200."""
    status, data = request(url, "POST", path, body)
    assert status == 200, (url, path, status, data)
    return data


def sample_everywhere(urls: list[str] | None, rank: int, world: int, **sampling: Any,
                      ) -> list[tuple[str, list[int], list[int], list[float], str]]:
    """Rank 0 asks every server to continue every prompt of `PROMPTS` by `NEW` tokens with
    `sampling` (SGLang's sampling params); every rank gets (url, prompt, output ids, their
    logprobs, the weight version that served them) per call. Collective when `world` > 1."""
    import torch.distributed as dist

    gens = None
    if rank == 0:
        gens = []
        for url in urls or []:
            for prompt in PROMPTS:
                body = post_ok(url, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
                    "max_new_tokens": NEW, "ignore_eos": True, **sampling}})
                info = body["meta_info"]
                gens.append((url, prompt, body["output_ids"], [p[0] for p in info["output_token_logprobs"]],
                             info["weight_version"]))
    box = [gens]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
