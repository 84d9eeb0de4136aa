"""Tandem's trainer updating a real vLLM server (CPU build) through Tandem's worker extension
(`tandem.weights.vllm_worker`, loaded with `--worker-extension-cls`): a transfer group over gloo,
buckets staged in the worker and loaded at the commit, pipelined or serial, from disk too; a bad
update leaves the served weights alone; and an update in the middle of generation, where every
token's logprob matches the model of the version it is labelled with."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import transformers

from tandem.fleet import ops
from tandem.fleet.adapters import VLLMAdapter
from tandem.fleet.generation import GenerationParams
from tandem.fleet.http import HttpFleet
from tandem.fleet.results import FleetResult
from tandem.models import load_model
from tandem.rollout.types import ModelRequest, ModelResponse
from tandem.rollout.version import WeightVersion
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import WeightSyncError
from tandem.weights.updater import WeightUpdater
from tests.engines.conftest import busy_engine, init_model, start_decoding
from tests.engines.test_vllm import (
    LONG_DEADLINE_S,
    PROMPTS,
    client_for,
    generate,
    generate_in_background,
    get,
    recomputed,
)
from tests.weights.common import CheckpointSource

DEADLINES = ops.Deadlines(init_group_s=60.0, bucket_s=60.0, update_s=300.0, http_s=60.0)
BUCKET = 1024**2  # the small preset (~12 MB in fp32) travels in about ten buckets


def fleet_for(server) -> HttpFleet:
    return HttpFleet([server.url], adapter=VLLMAdapter(server.name, extension=True), deadlines=DEADLINES)


def greedy(server, version: int) -> list[list[int]]:
    params = GenerationParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    got = generate(client_for(server, WeightVersion(version)), [ModelRequest(list(p), params) for p in PROMPTS])
    assert all(r.output_versions == [version] * 12 for r in got)
    return [r.output_ids for r in got]


def hf_greedy(path) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
            out.append(want[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("seed1") / "seed1", 1)


@pytest.mark.parametrize("pipeline", [True, False])
def test_distributed_update_over_a_group(vllm_server, other_model, pipeline):
    """Seed 1's weights go over the group (flat buckets); vLLM then decodes as transformers does on
    seed 1; the original weights go back the same way."""
    with fleet_for(vllm_server) as fleet:
        assert fleet.capabilities.staged_commit and fleet.capabilities.flat_buckets
        for version, path in ((11, other_model), (12, vllm_server.model)):
            meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=DEADLINES)
            with WeightUpdater(CheckpointSource(path), fleet, meta, pipeline=pipeline) as updater:
                report = updater.update(version)
            print(f"pipeline={pipeline} v{version}: {report.buckets} buckets, {report.bytes / 1e6:.0f} MB in "
                  f"{report.seconds:.2f}s; phases {({k: round(v, 2) for k, v in report.phases.items()})}")
            assert report.buckets >= 4, report
            assert get(vllm_server, "/weight_info") == {"weight_version": str(version)}
            assert greedy(vllm_server, version) == hf_greedy(path), version


def test_staged_disk_update(vllm_server, other_model, tmp_path):
    """A disk update staged in the worker (`tandem_stage_disk`) and loaded at the commit."""
    with fleet_for(vllm_server) as fleet:
        for version, path in ((21, other_model), (22, vllm_server.model)):
            meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "versions"), deadlines=DEADLINES)
            with WeightUpdater(CheckpointSource(path), fleet, meta) as updater:
                updater.update(version)
            assert get(vllm_server, "/weight_info") == {"weight_version": str(version)}
            assert greedy(vllm_server, version) == hf_greedy(path), version


def test_a_bad_update_leaves_the_served_weights_alone(vllm_server, other_model):
    """A bucket whose tensor does not fit the served model fails in the worker, the staged buckets
    are discarded, and the server still decodes with the weights it had (version unchanged); the
    group formed again afterwards carries a good update."""
    src = CheckpointSource(other_model)
    broken = CheckpointSource(other_model, break_shape=list(src.tensors)[-1])
    with fleet_for(vllm_server) as fleet:
        fleet.send(ops.SET_VERSION, ops.SetVersion(30)).result(30)
        before = greedy(vllm_server, 30)  # vLLM labels the tokens 30
        version_before = get(vllm_server, "/weight_info")
        meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=DEADLINES)
        with WeightUpdater(broken, fleet, meta) as updater, pytest.raises(WeightSyncError, match="shape"):
            updater.update(31)
        assert get(vllm_server, "/weight_info") == version_before
        assert greedy(vllm_server, 30) == before
        with WeightUpdater(CheckpointSource(vllm_server.model), fleet, meta) as updater:
            updater.update(32)
    assert get(vllm_server, "/weight_info") == {"weight_version": "32"}


class LabellingFleet:
    """A fleet that moves the client's version when the servers' is set, before the call returns
    (as the rollout controller's fleet does): tokens generated after `continue` carry it. With a
    `watched` request, it also notes whether that request had already finished when PAUSE went out."""

    def __init__(self, fleet: HttpFleet, version: WeightVersion, watched: Future | None = None):
        self.fleet, self.version, self.watched = fleet, version, watched
        self.done_at_pause: bool | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fleet, name)

    def send(self, op: ops.FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        if op is ops.PAUSE and self.watched is not None and self.done_at_pause is None:
            self.done_at_pause = self.watched.done()
        inner, outer = self.fleet.send(op, request, targets), Future()

        def settle(fut: Future[FleetResult]) -> None:
            if fut.exception() is not None:
                outer.set_exception(fut.exception())
                return
            if op is ops.SET_VERSION:
                self.version.set(request.version)
            outer.set_result(fut.result())

        inner.add_done_callback(settle)
        return outer


def _update_during_a_request(vllm_server, other_model, budget: int) -> tuple[ModelResponse, bool]:
    """One long request at seed 0 / version 0 and, once it decodes, an update to seed 1 / version 1
    over the group; returns the response and whether the request had already finished when the
    update's PAUSE went out. Leaves the server at seed 0 / version 0."""
    version = WeightVersion(0)
    with fleet_for(vllm_server) as fleet:
        fleet.send(ops.SET_VERSION, ops.SetVersion(0)).result(30)
    client = client_for(vllm_server, version, deadline_s=LONG_DEADLINE_S)
    params = GenerationParams(max_new_tokens=budget, temperature=0.7, ignore_eos=True)
    # The checkpoint is read and the updater built before generation starts, so that only `update`
    # runs between the first tokens and its pause (torch's two threads here and vLLM's busy core
    # slow each other down tenfold).
    source = CheckpointSource(other_model)
    meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=DEADLINES)
    try:
        with fleet_for(vllm_server) as http:
            labelling = LabellingFleet(http, version)
            with WeightUpdater(source, labelling, meta) as updater, busy_engine(vllm_server):
                running = labelling.watched = start_decoding(
                    lambda: generate_in_background(client, ModelRequest(list(PROMPTS[0]), params)))
                try:
                    updater.update(1)
                finally:
                    concurrent.futures.wait([running], LONG_DEADLINE_S + 30)  # the group outlives the request
        [r] = running.result(LONG_DEADLINE_S + 30)  # raises what the request raised
        return r, bool(labelling.done_at_pause)
    finally:
        with fleet_for(vllm_server) as fleet:  # back to seed 0 for the next attempt and the other tests
            meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=DEADLINES)
            with WeightUpdater(CheckpointSource(vllm_server.model), fleet, meta) as updater:
                updater.update(0)


def test_update_in_the_middle_of_generation(vllm_server, other_model):
    """A long request is running when the trainer updates the server to seed 1 over the group: the
    pause aborts it, the client resubmits prompt + partial output, and it finishes on the new
    weights. Tokens labelled 0 have seed 0's logprobs, tokens labelled 1 seed 1's (each recomputed
    by Tandem's model teacher-forced on everything before it). The update starts 1 s after the
    request, 32 others decoding beside it (`busy_engine`): an attempt where its pause did not cut the request (the request had not
    started or had finished when the pause reached the engine: a stalled machine) shows nothing
    and is made again, up to 5 times; a pause that does not abort a running request fails every
    attempt."""
    budget = 4096 - len(PROMPTS[0]) - 1  # max_model_len: as long as a request can run
    for attempt in range(1, 6):
        r, finished_first = _update_during_a_request(vllm_server, other_model, budget)
        before = r.output_versions.count(0)
        if not finished_first and r.num_aborts >= 1 and before > 0:
            break
        print(f"attempt {attempt}: the update's pause did not cut the request (finished first: {finished_first}, "
              f"aborts {r.num_aborts}, {before} tokens at v0); again")
    else:
        pytest.fail("in 5 attempts the update's pause never cut the running request")
    assert before < budget, before
    assert r.output_versions == [0] * before + [1] * (budget - before)
    worst = []
    for model, segment in ((load_model(vllm_server.model), slice(0, before)),
                           (load_model(other_model), slice(before, budget))):
        want = recomputed(model, r.input_ids, r.output_ids, 0.7)[segment]
        worst.append((torch.tensor(r.output_logprobs[segment]) - want).abs().max().item())
    print(f"update mid-generation (attempt {attempt}): {before} tokens at v0, {budget - before} at v1; max logprob "
          f"error {worst[0]:.2e} (v0), {worst[1]:.2e} (v1)")
    assert max(worst) < 1e-5
