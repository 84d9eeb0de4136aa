"""The fleet operation table against every layer and every server adapter.

Every operation in `OPS` has an example request here; each one must travel as JSON and back, be
mapped (or explicitly refused) by every adapter, and reach a real HTTP server through each layer
(`HttpFleet`, the controller's own `send`, and `RolloutCallback` -> callback route -> controller)
as exactly the call the adapter maps it to."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tandem.fleet import ops
from tandem.fleet.adapters import SERVER_KINDS, HttpCall, UnsupportedOperation, adapter_for
from tandem.fleet.http import HttpFleet
from tandem.fleet.interface import call
from tandem.fleet.results import FleetResult, ServerChecksums, ServerResult
from tandem.fleet.wire import WireError, from_json, to_json
from tandem.rollout import RolloutConfig, RolloutController

pytestmark = pytest.mark.timeout(60)

SPECS = (ops.ParamSpec("a", (2, 3), "bfloat16"), ops.ParamSpec("b", (4,), "float32"))
EXAMPLES: dict[str, object] = {
    "pause_generation": ops.PauseGeneration(),
    "continue_generation": ops.ContinueGeneration(),
    "set_version": ops.SetVersion(7),
    "join_group": ops.JoinGroup("127.0.0.1", 29501, "g", "gloo", (1, 1), 30.0),
    "leave_group": ops.LeaveGroup("g"),
    "stage_distributed": ops.DistributedBucket("g", SPECS, bucket_index=2, flat=ops.FlatLayout((0, 64), 80),
                                               commit=False),
    "stage_shm": ops.SharedMemoryBucket(ops.ShmBucket(SPECS, (0, 64), 80, segment="tandem-w-1-0", zero_copy=True),
                                        bucket_index=0, commit=False),
    "load_disk": ops.DiskLoad("/w/v00000007", commit=False),
    "commit": ops.CommitStaged(7),
    "discard": ops.DiscardStaged(),
    "checksums": ops.ChecksumsRequest(("a",)),
}
ANSWERS = {ops.Acknowledged: ops.Acknowledged(), ServerChecksums: ServerChecksums("float32", {"a": "00"}, 7)}


def test_every_operation_has_an_example_and_a_well_formed_entry():
    assert set(EXAMPLES) == set(ops.OPS), "add an example request for each new operation"
    for name in ops.OPS:
        op = ops.OPS[name]
        assert op.name == name and isinstance(EXAMPLES[name], op.request) and op.answer in ANSWERS
        assert ops.Deadlines().seconds(op.deadline) > 0


@pytest.mark.parametrize("name", list(ops.OPS))
def test_requests_and_answers_travel_as_json(name):
    op = ops.OPS[name]
    request = EXAMPLES[name]
    assert from_json(op.request, json.loads(json.dumps(to_json(request)))) == request
    answer = ANSWERS[op.answer]
    result = FleetResult(name, (ServerResult("a", True, "ok", answer), ServerResult("b", False, "no")))
    back = from_json(FleetResult, json.loads(json.dumps(to_json(result))))
    assert from_json(op.answer, back.results[0].value) == answer and back.results[1] == result.results[1]


def test_the_wire_names_the_field_that_does_not_fit():
    with pytest.raises(WireError, match=r"body.specs\[0\].shape\[1\]: expected int"):
        from_json(ops.DistributedBucket, {"group_name": "g", "specs": [{"name": "a", "shape": [2, "x"],
                                                                         "dtype": "float32"}]})
    with pytest.raises(WireError, match=r"body.version is missing"):
        from_json(ops.CommitStaged, {})
    with pytest.raises(WireError, match=r"unknown field\(s\) \['verison'\]"):
        from_json(ops.CommitStaged, {"version": 1, "verison": 2})


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_every_adapter_maps_or_refuses_every_operation(kind):
    adapter = adapter_for(kind)
    mapped = []
    for name, op in ops.OPS.items():
        try:
            http = adapter.request(op, EXAMPLES[name], 1)
        except UnsupportedOperation as exc:
            assert (kind in str(exc) and name in str(exc)) or "tandem server" in str(exc), (kind, name, exc)
            continue
        assert isinstance(http, HttpCall) and http.path.startswith("/") and json.dumps(http.body)
        mapped.append(name)
    if kind == "tandem":  # every capability: every operation
        assert mapped == list(ops.OPS)
    if kind == "sglang":  # SGLang's own routes; staged options are refused, full-set transfers go
        assert set(mapped) == {"pause_generation", "continue_generation", "set_version", "join_group", "leave_group"}
        full = ops.DistributedBucket("g", SPECS)
        assert adapter.request(ops.STAGE_DISTRIBUTED, full, 0).path == "/update_weights_from_distributed"
    if kind == "vllm":  # vLLM's RL/dev routes, applied on arrival; no transfer group mapped yet
        assert set(mapped) == {"pause_generation", "continue_generation", "set_version"}
        assert adapter.request(ops.LOAD_DISK, ops.DiskLoad("/w"), 0).path == "/collective_rpc"
    if "join_group" in mapped:
        assert adapter.request(ops.JOIN_GROUP, EXAMPLES["join_group"], 1).body["rank_offset"] == 2


def test_a_commit_aborts_in_flight_requests_only_where_the_servers_can():
    """tandem serve aborts its running requests and swaps in one engine step: `abort_all` becomes
    its route's `abort_all_requests`. vLLM's worker extension commits without aborting: asked to,
    it is refused naming the way (a pause before the commit), not sent a commit that would not."""
    tandem = adapter_for("tandem")
    assert tandem.capabilities.commit_aborts
    assert tandem.request(ops.COMMIT, ops.CommitStaged(7, abort_all=True), 0).body == {
        "weight_version": "7", "abort_all_requests": True}
    assert tandem.request(ops.COMMIT, ops.CommitStaged(7), 0).body == {"weight_version": "7"}
    vllm = adapter_for("vllm", vllm_extension=True)
    assert not vllm.capabilities.commit_aborts and vllm.request(ops.COMMIT, ops.CommitStaged(7), 0)
    with pytest.raises(UnsupportedOperation, match=r"vllm servers do not abort in-flight requests at the commit; "
                                                   r"pause them before it"):
        vllm.request(ops.COMMIT, ops.CommitStaged(7, abort_all=True), 0)


class _Recorder(BaseHTTPRequestHandler):
    """Records every request (GET ones with an empty body) and answers like a tandem server that
    accepts everything."""

    calls: ClassVar[list[tuple[str, dict]]] = []

    def do_GET(self):
        self.calls.append((self.path, {}))
        self._answer()

    def do_POST(self):
        self.calls.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")))
        self._answer()

    def _answer(self):
        answer = {"success": True, "message": "ok", "dtype": "float32", "checksums": {"a": "00"},
                  "weight_version": "7"}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    _Recorder.calls = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_every_layer_carries_every_operation_to_the_server(recorder):
    adapter = adapter_for("tandem")
    ctl = RolloutController(RolloutConfig(servers=[recorder]))
    direct = HttpFleet([recorder])
    callback = ctl.callback()
    try:
        for layer in (direct, ctl, callback):
            for name, op in ops.OPS.items():
                _Recorder.calls.clear()
                if op is ops.SET_VERSION:  # a version the fleet already knows is not sent again
                    call(layer, ops.CONTINUE, ops.ContinueGeneration())
                    _Recorder.calls.clear()
                result = call(layer, op, EXAMPLES[name])
                expected = adapter.request(op, EXAMPLES[name], 0)
                calls = [c for c in _Recorder.calls if c[0] != "/health"]  # the controller's health probes
                assert calls == [(expected.path, expected.body)], (type(layer).__name__, name)
                assert result.phase == name and [r.address for r in result.results] == [recorder]
                assert result.values()[recorder] == ANSWERS[op.answer], (type(layer).__name__, name)
        assert ctl.version.value == 7  # set_version through the controller moved the rollout side's version
    finally:
        callback.close()
        direct.close()
        ctl.shutdown()


@pytest.mark.parametrize(("kind", "update_type", "missing"), [
    ("vllm", "distributed", "weight updates over a transfer group"),
    ("sglang", "shm", "staged transfers")])
def test_an_updater_refuses_servers_that_lack_what_its_transport_needs(kind, update_type, missing):
    from tandem.weights.meta import WeightUpdateMeta
    from tandem.weights.report import WeightSyncError
    from tandem.weights.updater import WeightUpdater

    assert adapter_for("tandem").capabilities.missing_for(update_type) is None
    if update_type != "shm":  # without staged commit, disk and distributed fall back to SGLang's semantics
        assert adapter_for("sglang").capabilities.missing_for(update_type) is None
    with HttpFleet(["http://127.0.0.1:9"], adapter=adapter_for(kind)) as fleet:
        meta = WeightUpdateMeta(update_type, path="/w" if update_type == "disk" else None)
        with pytest.raises(WeightSyncError, match=f"weight_sync='{update_type}' needs {missing}"):
            WeightUpdater(object(), fleet, meta)  # refused before any server is called


def test_vllm_in_lora_mode_loads_adapters_and_generates_under_their_name():
    """`VLLMAdapter(lora=True)`: an adapter disk load is vLLM's `/v1/load_lora_adapter` under the
    adapter's name, in place, applied on arrival (no staging, the version set after it); whole
    weights, staged loads, versioned loads and transfer-group ops are refused; generation names the
    adapter. The name is `rollout.model`, or `policy` when none is given."""
    adapter = adapter_for("vllm", "pol", vllm_extension=True, vllm_lora=True)
    load = adapter.request(ops.LOAD_DISK, ops.DiskLoad("/w/v00000003", adapter=True), 0)
    assert load == HttpCall("/v1/load_lora_adapter", {"lora_name": "pol", "lora_path": "/w/v00000003",
                                                      "load_inplace": True})
    assert adapter_for("vllm", vllm_lora=True).request(ops.LOAD_DISK, ops.DiskLoad("/w", adapter=True), 0).body[
        "lora_name"] == "policy"
    caps = adapter.capabilities
    assert caps.adapter_updates == ("disk",) and not caps.staged_commit and not caps.commit_sets_version
    assert caps.missing_for("disk") is None and caps.missing_for("distributed") and caps.missing_for("shm")
    assert adapter.request(ops.SET_VERSION, ops.SetVersion(3), 0).path == "/update_weight_version"
    assert adapter.request(ops.PAUSE, ops.PauseGeneration(), 0).path == "/pause?mode=abort"
    refused = {"whole weights": ops.DiskLoad("/w"), "staged": ops.DiskLoad("/w", commit=False, adapter=True),
               "set_version after it": ops.DiskLoad("/w", version=3, adapter=True)}
    for why, request in refused.items():
        with pytest.raises(UnsupportedOperation, match=why.split()[0]):
            adapter.request(ops.LOAD_DISK, request, 0)
    for name in ("join_group", "stage_distributed", "commit", "discard", "checksums"):
        with pytest.raises(UnsupportedOperation, match=f"vllm servers have no '{name}'"):
            adapter.request(ops.OPS[name], EXAMPLES[name], 0)
    from tandem.fleet.generation import GenerationParams

    assert adapter.generate_body("r", [1, 2], GenerationParams(), 4)["model"] == "pol"
    # Without LoRA mode, vLLM refuses adapter loads (merged weights are sent instead).
    with pytest.raises(UnsupportedOperation, match="LoRA adapters"):
        adapter_for("vllm", vllm_extension=True).request(ops.LOAD_DISK, ops.DiskLoad("/w", adapter=True), 0)


class _AdapterSource:
    """A trainer whose disk export is a PEFT adapter directory (what `save_hf` writes while the
    engine syncs adapters)."""

    def save_hf(self, path, overwrite=False):
        path.mkdir(parents=True, exist_ok=overwrite)
        (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
        (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
        return path


def test_an_adapter_update_to_vllm_in_lora_mode_pauses_loads_sets_the_version_and_resumes(recorder, tmp_path):
    """The whole update, over HTTP, as `tandem train` sends it to a vLLM server in LoRA mode: the
    adapter directory of each version is new, loaded under the adapter's name while generation is
    paused, then the version is set; older versions' directories are deleted once the next loaded."""
    from tandem.weights.meta import WeightUpdateMeta
    from tandem.weights.updater import WeightUpdater

    meta = WeightUpdateMeta("disk", path=str(tmp_path / "weights"), lora_alpha=16.0)
    with HttpFleet([recorder], adapter=adapter_for("vllm", "pol", vllm_lora=True)) as fleet, \
            WeightUpdater(_AdapterSource(), fleet, meta) as updater:
        for version in (0, 1):
            _Recorder.calls.clear()
            updater.update(version)
            path = str(tmp_path / "weights" / f"v{version:08d}")
            assert _Recorder.calls == [
                ("/pause?mode=abort", {}),
                ("/v1/load_lora_adapter", {"lora_name": "pol", "lora_path": path, "load_inplace": True}),
                ("/update_weight_version", {"new_version": str(version)}),
                ("/resume", {})]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000001"]


def test_a_vllm_server_joining_a_lora_run_is_warmed_with_the_adapter(tmp_path):
    """Warm-up for servers without staging, checksums or a version set by the load (vLLM in LoRA
    mode): the joiner loads the warm-up copy of the adapter (a directory of this version's own),
    then takes this update with the members (pause, this version's adapter, set_version, resume)
    and is admitted; nothing it cannot serve (discard, leave_group, checksums) is sent."""
    import time

    from tandem.rollout.config import VLLMLaunchConfig
    from tandem.rollout.health import HealthConfig
    from tandem.weights.meta import WeightUpdateMeta
    from tandem.weights.updater import WeightUpdater

    servers, handlers = [], []
    for name in ("Member", "Joiner"):
        handler = type(name, (_Recorder,), {"calls": []})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        handlers.append(handler)
    member, joiner = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    config = RolloutConfig(backend="vllm:d1", servers=[member], vllm=VLLMLaunchConfig(lora_rank=8),
                           health=HealthConfig(interval_s=0.1, timeout_s=30.0), topology_cooldown_s=0.0)
    ctl = RolloutController(config)
    weights = tmp_path / "weights"
    meta = WeightUpdateMeta("disk", path=str(weights), warmup_dir=str(weights), lora_alpha=16.0)
    try:
        ctl.fleet.join(joiner, None)
        deadline = time.monotonic() + 30
        while joiner not in ctl.topology().warming and time.monotonic() < deadline:
            time.sleep(0.05)  # the health monitor's probe moves it to warming
        assert ctl.topology().warming == (joiner,)
        with WeightUpdater(_AdapterSource(), ctl, meta) as updater:
            report = updater.update(5)
        assert report.warmed == (joiner,) and set(ctl.topology().members) == {member, joiner}
        load = {"lora_name": "policy", "load_inplace": True}
        update = [("/pause?mode=abort", {}), ("/v1/load_lora_adapter", {**load, "lora_path": str(weights / "v00000005")}),
                  ("/update_weight_version", {"new_version": "5"}), ("/resume", {})]
        calls = [[c for c in h.calls if c[0] != "/health"] for h in handlers]
        assert calls[0] == update
        assert calls[1] == [("/v1/load_lora_adapter", {**load, "lora_path": str(weights / "warmup-v00000005")}),
                            *update]
        assert not (weights / "warmup-v00000005").exists()  # deleted once loaded
    finally:
        ctl.shutdown()
        for s in servers:
            s.shutdown()
            s.server_close()
