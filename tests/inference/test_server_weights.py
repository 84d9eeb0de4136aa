"""Weight updates over HTTP: from disk and over a distributed (gloo) group whose rank 0 is a separate
"trainer" process. Good updates change the outputs to exactly those of the new weights; failed
ones (bad path, wrong shapes, missing tensors, broken group) change nothing."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from tandem.inference.engine import LLMEngine
from tandem.inference.sampling_params import SamplingParams
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.models.tiny import init_model
from tandem.weights.shm import ShmWriter
from tests.inference.conftest import OVERFLOW_TOKEN, make_model_dir, prompts
from tests.inference.server_utils import ServerProcess, sse_events, wait_for

BATCH = prompts([9, 21, 3], seed=7)
NEW = 12
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    """Where this module's disk updates come from: a directory the server is told it may read."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def new_dir(weights_root):
    return make_model_dir(weights_root, "qwen3", seed=1)


@pytest.fixture(scope="module")
def server(qwen3_dir, weights_root, overflow_dir, tmp_path_factory):
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--kv-cache-tokens", "4096",
                        "--weight-sync-timeout", "20", "--weights-dir", str(weights_root),
                        "--weights-dir", str(overflow_dir), env={"TANDEM_FAULT_INJECTION": "1"})
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def expected(model_dir) -> list[list[int]]:
    engine = LLMEngine(model_dir, kv_cache_tokens=1024)
    return [o.output_ids for o in engine.generate(BATCH, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                                        ignore_eos=True))]


def served(server) -> tuple[list[list[int]], str]:
    outs = [server.ok("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                                         "ignore_eos": True}}) for ids in BATCH]
    versions = {o["meta_info"]["weight_version"] for o in outs}
    assert len(versions) == 1
    return [o["output_ids"] for o in outs], versions.pop()


def rewritten_copy(src, dst, edit):
    """A copy of the model directory `src` whose tensors (a dict) went through `edit`."""
    shutil.copytree(src, dst)
    tensors = dict(iter_hf_tensors(src))
    for f in dst.glob("*.safetensors"):
        f.unlink()
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def poisoned_copy(src, dst, name=Q, value=float("nan")):
    """A copy of the model directory `src` whose tensor `name` holds `value` at one element."""

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value

    return rewritten_copy(src, dst, poison)


def assert_failed(status, body, needle):
    assert status == 400 and body["success"] is False, body
    assert needle in body["message"], body["message"]


def test_update_from_disk(server, qwen3_dir, new_dir, weights_root):
    old_out, new_out = expected(qwen3_dir), expected(new_dir)
    assert old_out != new_out
    assert served(server) == (old_out, "0")
    # Failed updates: nothing changes (outputs and version).
    wrong = init_model(weights_root / "small", arch="qwen3", preset="small", seed=0)
    missing = rewritten_copy(new_dir, weights_root / "missing", lambda tensors: tensors.pop(Q))
    for path, needle in [(str(weights_root / "does-not-exist"), "cannot read a checkpoint"), (str(wrong), "has shape"),
                         (str(missing), f"missing tensor(s): {Q}")]:
        status, body = server.post("/update_weights_from_disk", {"model_path": path, "weight_version": "99"})
        assert_failed(status, body, needle)
        assert served(server) == (old_out, "0")
    status, body = server.post("/update_weights_from_disk", {"model_path": str(new_dir), "load_format": "pickle"})
    assert status == 400 and body["object"] == "error"
    # A good one: exactly the new weights' outputs, under the new version.
    res = server.ok("/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "1",
                                                  "abort_all_requests": True})
    assert res["success"] is True and res["weight_version"] == "1"
    assert served(server) == (new_out, "1")
    assert server.ok("/get_model_info", method="GET")["weight_version"] == "1"
    server.ok("/update_weights_from_disk", {"model_path": str(qwen3_dir), "weight_version": "0"})
    assert served(server) == (old_out, "0")


# ------------------------------------------------------------------------------ distributed
def _trainer(port_q, cmd_q, result_q, world_size):
    """Rank 0 of the weight group, in its own process: hosts the store, broadcasts on command."""
    from tandem.weights import host_store, init_weight_group

    store = host_store("127.0.0.1", 0)
    port_q.put(store.port)
    group = None
    while True:
        cmd, arg = cmd_q.get()
        try:
            if cmd == "join":
                group = init_weight_group("127.0.0.1", store.port, 0, world_size, timeout_s=20, store=store)
                result_q.put(("ok", group.rank))
            elif cmd == "send":  # [(name, tensor)]: broadcast each in order
                for _, t in arg:
                    group.broadcast(t.contiguous(), src=0)
                result_q.put(("ok", len(arg)))
            elif cmd == "die":  # send a part, then vanish mid-transfer
                for _, t in arg:
                    group.broadcast(t.contiguous(), src=0)
                result_q.put(("ok", "dying"))
                os._exit(0)
            elif cmd == "leave":
                group.destroy()
                result_q.put(("ok", None))
            elif cmd == "stop":
                result_q.put(("ok", None))
                os._exit(0)
        except Exception as exc:  # report, keep serving commands
            result_q.put(("error", repr(exc)))


class Trainer:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.port_q, self.cmd_q, self.result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_trainer, args=(self.port_q, self.cmd_q, self.result_q, 2), daemon=True)
        self.proc.start()
        self.port = self.port_q.get(timeout=60)

    def do(self, cmd, arg=None):
        self.cmd_q.put((cmd, arg))

    def result(self, timeout=60):
        return self.result_q.get(timeout=timeout)

    def close(self):
        if self.proc.is_alive():
            self.do("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _join(server, trainer, pool):
    trainer.do("join")
    res = pool.submit(server.ok, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1, "world_size": 2,
        "group_name": "weight_update_group", "backend": "gloo"})
    assert trainer.result()[0] == "ok"
    assert res.result(60)["success"] is True


def _meta(tensors, **extra):
    return {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "group_name": "weight_update_group", **extra}


def test_update_from_distributed(server, qwen3_dir, new_dir):
    old_out, new_out = expected(qwen3_dir), expected(new_dir)
    tensors = list(iter_hf_tensors(new_dir))
    trainer = Trainer()
    try:
        with ThreadPoolExecutor(2) as pool:
            _join(server, trainer, pool)
            # Wrong shape: the server receives (and drops) what is declared, answers false.
            bad = [(n, t[:-1] if n == Q else t) for n, t in tensors]
            trainer.do("send", bad)
            status, body = server.post("/update_weights_from_distributed", _meta(bad, weight_version="99"))
            assert trainer.result()[0] == "ok"
            assert_failed(status, body, "has shape")
            assert served(server) == (old_out, "0")
            # A one-shot bucket may be any subset (SGLang's semantics): its tensors are applied at
            # once, the others keep serving unchanged.
            before = server.ok("/get_weights_checksum", {})["checksums"]
            part = [(n, t) for n, t in tensors if n != Q]
            trainer.do("send", part)
            res = pool.submit(server.ok, "/update_weights_from_distributed", _meta(part, weight_version="1"))
            assert trainer.result()[0] == "ok"
            assert res.result(60)["weight_version"] == "1"
            after = server.ok("/get_weights_checksum", {})["checksums"]
            assert after[Q] == before[Q] and all(after[n] != before[n] for n, _ in part), "partial bucket"
            # A full, correct set: outputs are exactly the new weights', version as sent.
            trainer.do("send", tensors)
            res = pool.submit(server.ok, "/update_weights_from_distributed", _meta(tensors, weight_version="2"))
            assert trainer.result()[0] == "ok"
            assert res.result(60)["success"] is True
            assert served(server) == (new_out, "2")
            # Broken group: the trainer dies after half the tensors.
            back = list(iter_hf_tensors(qwen3_dir))
            trainer.do("die", back[: len(back) // 2])
            status, body = server.post("/update_weights_from_distributed", _meta(back, weight_version="3"),
                                       timeout=60)
            assert_failed(status, body, "failed")
            trainer.proc.join(10)
            assert served(server) == (new_out, "2")
            assert server.ok("/destroy_weights_update_group", {"group_name": "weight_update_group"})["success"]
            status, body = server.post("/destroy_weights_update_group", {"group_name": "weight_update_group"})
            assert_failed(status, body, "no weight group")
            status, body = server.post("/update_weights_from_distributed", _meta(back))
            assert_failed(status, body, "no weight group")
    finally:
        trainer.close()
    # A fresh trainer (new store) can form a new group with the same name and restore the weights.
    trainer = Trainer()
    try:
        with ThreadPoolExecutor(2) as pool:
            _join(server, trainer, pool)
            back = [(n, t.to(torch.bfloat16)) for n, t in iter_hf_tensors(qwen3_dir)]  # cast on load
            trainer.do("send", back)
            res = pool.submit(server.ok, "/update_weights_from_distributed", _meta(back, weight_version="0"))
            assert trainer.result()[0] == "ok"
            assert res.result(60)["success"] is True
            trainer.do("leave")
            assert trainer.result()[0] == "ok"
            server.ok("/destroy_weights_update_group", {})
    finally:
        trainer.close()
    outs, version = served(server)
    assert version == "0" and len(outs) == len(old_out)


def test_group_errors(server):
    status, body = server.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                              "rank_offset": 0, "world_size": 2})
    assert_failed(status, body, "rank 0 is the trainer")
    status, body = server.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                              "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert_failed(status, body, "needs a CUDA server")
    status, body = server.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x"})
    assert status == 400 and body["object"] == "error"


def test_an_unexpected_error_answers_500_in_the_error_format(server):
    """A bug (stood in for by an injected exception) answers JSON, not starlette's plain text."""
    server.ok("/_fault", {"route": "update_weights_from_disk", "action": "error"})
    status, body = server.post("/update_weights_from_disk", {"model_path": "/x"})
    assert status == 500, body
    assert body == {"object": "error", "code": 500, "type": "Internal Server Error",
                    "message": "internal error on POST /update_weights_from_disk (RuntimeError: injected bug on "
                               "/update_weights_from_disk); see the server log"}
    status, body = server.get("/health")
    assert status == 200 and body["status"] == "ok", body


def test_a_checkpoint_with_nan_never_becomes_healthy(qwen3_dir, tmp_path):
    bad = poisoned_copy(qwen3_dir, tmp_path / "nan")
    srv = ServerProcess(bad, tmp_path, wait_healthy=False)
    try:
        status, body = wait_for(lambda: (r := srv.get("/health"))[1]["status"] != "starting" and r)
        message = f"tensor '{Q}' in '{bad / 'model.safetensors'}' holds NaN values"
        assert status == 503 and body["status"] == "broken" and message in body["message"], body
        assert srv.post("/generate", {"input_ids": [11, 12]})[0] == 503
        assert message in srv.log.read_text()
    finally:
        srv.stop()


def _shm_update(server, buckets, version):
    """Stage `buckets` (lists of (name, tensor)) from one shared-memory segment, then commit."""
    writer = ShmWriter()
    try:
        for k, bucket in enumerate(buckets):
            segment, offsets, nbytes, _ = writer.write([t for _, t in bucket])
            meta = {key: v for key, v in _meta(bucket).items() if key != "group_name"}
            server.ok("/update_weights_from_shm", {**meta, "segment": segment, "offsets": offsets, "nbytes": nbytes,
                                                   "commit": False, "bucket_index": k})
        return server.post("/commit_staged_weights", {"weight_version": version})
    finally:
        writer.close()


def test_non_finite_updates_are_refused_by_every_route_and_change_nothing(server, qwen3_dir, new_dir, weights_root):
    old_out = expected(qwen3_dir)
    server.ok("/update_weights_from_disk", {"model_path": str(qwen3_dir), "weight_version": "0"})
    assert served(server) == (old_out, "0")
    # Disk, one shot and staged.
    bad = poisoned_copy(new_dir, weights_root / "nan")
    for commit in (True, False):
        status, body = server.post("/update_weights_from_disk", {"model_path": str(bad), "weight_version": "99",
                                                                 "commit": commit})
        assert_failed(status, body, f"tensor '{Q}' in '{bad / 'model.safetensors'}' holds NaN values")
        assert served(server) == (old_out, "0")
    # Distributed, one shot: received whole, refused before the swap.
    tensors = list(iter_hf_tensors(new_dir))
    inf = [(n, t.clone().index_fill_(1, torch.tensor([5]), float("inf")) if n == Q else t) for n, t in tensors]
    trainer = Trainer()
    try:
        with ThreadPoolExecutor(2) as pool:
            _join(server, trainer, pool)
            trainer.do("send", inf)
            status, body = server.post("/update_weights_from_distributed", _meta(inf, weight_version="99"))
            assert trainer.result()[0] == "ok"
            assert_failed(status, body, f"weight update tensor {Q!r} holds inf values; the previous weights keep")
            assert served(server) == (old_out, "0")
            server.ok("/destroy_weights_update_group", {})
    finally:
        trainer.close()
    # Shared memory, two staged buckets (a NaN in the second): the commit refuses the set.
    half, last = len(tensors) // 2, tensors[-1][0]
    nan = [(n, t.clone().fill_(float("nan")) if n == last else t) for n, t in tensors]
    status, body = _shm_update(server, [nan[:half], nan[half:]], "99")
    assert_failed(status, body, f"weight update tensor {last!r} holds NaN values")
    assert served(server) == (old_out, "0")
    assert server.ok("/get_weight_version", method="GET") == {"weight_version": "0"}
    # The refused set left nothing behind: a good staged update then serves exactly the new weights.
    status, body = _shm_update(server, [tensors[:half], tensors[half:]], "4")
    assert status == 200 and body["success"], body
    assert served(server) == (expected(new_dir), "4")
    server.ok("/update_weights_from_disk", {"model_path": str(qwen3_dir), "weight_version": "0"})
    assert served(server) == (old_out, "0")


def test_non_finite_logits_fail_that_request_with_a_500(server, qwen3_dir, overflow_dir):
    """Finite weights whose activations overflow for one token: requests holding it answer 500 in
    the error format (before: "Out of range float values are not JSON compliant" as plain text),
    every other request keeps its exact outputs."""
    server.ok("/update_weights_from_disk", {"model_path": str(overflow_dir), "weight_version": "5"})
    want = expected(overflow_dir)
    assert served(server) == (want, "5")
    poison = [OVERFLOW_TOKEN, 20, 30]
    needle = "the model's logits were not finite (NaN or inf) at output token 1"
    for path, body in [("/generate", {"input_ids": poison, "return_logprob": True}),
                       ("/generate", {"input_ids": poison, "sampling_params": {"n": 2}}),
                       ("/v1/completions", {"prompt": poison, "max_tokens": 4, "logprobs": 1})]:
        status, answer = server.post(path, body)
        assert status == 500, answer
        assert answer["object"] == "error" and answer["code"] == 500 and answer["type"] == "Internal Server Error"
        assert needle in answer["message"], answer
        assert served(server) == (want, "5")
    events = sse_events(server.url, "/generate", {"input_ids": poison, "stream": True})
    assert events[-1] == "[DONE]" and events[-2]["code"] == 500 and needle in events[-2]["message"], events
    events = sse_events(server.url, "/v1/completions", {"prompt": poison, "max_tokens": 4, "stream": True})
    error = events[-2]["error"]  # where the openai client looks for it (it raises APIError)
    assert events[-1] == "[DONE]" and error["code"] == 500 and needle in error["message"], events
    assert server.get("/health") == (200, {"status": "ok", "weight_version": "5"})
    server.ok("/update_weights_from_disk", {"model_path": str(qwen3_dir), "weight_version": "0"})
    assert served(server) == (expected(qwen3_dir), "0")


def test_disk_updates_read_only_below_allowed_directories(server, qwen3_dir, new_dir, weights_root, overflow_dir,
                                                          tmp_path):
    """Allowed: the model's directory and each --weights-dir, compared as real paths. Anything else
    is 403 with one answer whether or not it exists (so the route cannot probe the file system)."""
    info = server.ok("/get_server_info", method="GET")
    assert info["weights_dir"] == [str(weights_root), str(overflow_dir)]
    server.ok("/update_weights_from_disk", {"model_path": str(qwen3_dir), "weight_version": "0"})
    old = served(server)
    outside = shutil.copytree(new_dir, tmp_path / "outside")  # a good checkpoint, outside every allowed directory
    (weights_root / "escape").symlink_to(outside)
    attempts = {
        "existing": str(outside),
        "missing": str(tmp_path / "missing"),
        "symlink out of an allowed directory": str(weights_root / "escape"),
        "dot-dot out of an allowed directory": f"{weights_root}/../{tmp_path.name}/outside",
        "relative": os.path.relpath(outside),  # the server runs in this process's directory
        "a sibling sharing the prefix": f"{weights_root}-not/x",
    }
    answers = set()
    for kind, path in attempts.items():
        status, body = server.post("/update_weights_from_disk", {"model_path": path, "weight_version": "99"})
        assert status == 403 and body["object"] == "error" and body["type"] == "Forbidden", (kind, body)
        answers.add(body["message"].replace(repr(path), "PATH"))
        assert served(server) == old, kind
    assert len(answers) == 1, answers
    message = answers.pop()
    assert "--weights-dir" in message and os.path.realpath(weights_root) in message, message
    # Allowed but missing: the answer does not change.
    status, body = server.post("/update_weights_from_disk", {"model_path": str(weights_root / "not-there")})
    assert_failed(status, body, "cannot read a checkpoint")
    # A path that leaves and re-enters an allowed directory, or a symlink inside it, is allowed.
    (weights_root / "alias").symlink_to(new_dir)
    for path in (f"{weights_root}/{new_dir.name}/../{new_dir.name}", str(weights_root / "alias")):
        assert server.ok("/update_weights_from_disk", {"model_path": path, "weight_version": "9"})["success"]
        assert served(server) == (expected(new_dir), "9")
    server.ok("/update_weights_from_disk", {"model_path": str(qwen3_dir), "weight_version": "0"})
    assert served(server) == old


def test_a_weight_version_that_is_not_an_integer_is_refused(server, qwen3_dir, new_dir):
    """Versions are integers, sent as strings ("7", SGLang's form): anything else is a 400 in the
    error format naming the field, before any weights are read, and nothing changes."""
    before = served(server)
    tensors = list(iter_hf_tensors(new_dir))[:1]
    shm = {key: v for key, v in _meta(tensors).items() if key != "group_name"}
    attempts = [
        ("/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "v1"}),
        ("/update_weights_from_distributed", _meta(tensors, weight_version="default")),
        ("/update_weights_from_shm", {**shm, "segment": "tandem-w-none", "offsets": [0], "nbytes": 1 << 20,
                                      "weight_version": "1.5"}),
        ("/commit_staged_weights", {"weight_version": " 3x"}),
    ]
    for path, body in attempts:
        status, answer = server.post(path, body)
        assert status == 400 and answer["object"] == "error", (path, answer)
        assert "field 'weight_version' must be an integer (e.g. \"7\")" in answer["message"], (path, answer)
    status, answer = server.post("/update_weight_version", {"new_version": "v7"})
    assert status == 400 and "field 'new_version' must be an integer (e.g. \"7\")" in answer["message"], answer
    assert served(server) == before
