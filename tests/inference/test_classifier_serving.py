"""`tandem serve --is-embedding`: a reward model (`...ForSequenceClassification`) or a value model
(`...ForTokenClassification`, one label) served on SGLang's `/classify` and vLLM's `/v1/classify`,
against transformers' own forward of the same checkpoint; bad input gets a 400 naming the field."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers

from tandem.models.tiny import init_model
from tests.inference.server_utils import ServerProcess

pytestmark = [pytest.mark.timeout(240)]
TOL = 1e-5


def _hf_classifier(root: Path, name: str, kind: str, labels: int) -> Path:
    """A randomly initialised transformers classifier of the tiny Qwen3 (its tokenizer beside it)."""
    base = init_model(root / f"{name}-base", preset="tiny", seed=0)
    config = transformers.AutoConfig.from_pretrained(base)
    config.num_labels = labels
    if labels == 3:
        config.id2label, config.label2id = {0: "bad", 1: "fine", 2: "good"}, {"bad": 0, "fine": 1, "good": 2}
    config.pad_token_id = 0
    torch.manual_seed(7)
    cls = {"sequence": transformers.AutoModelForSequenceClassification,
           "token": transformers.AutoModelForTokenClassification}[kind]
    model = cls.from_config(config)
    with torch.no_grad():  # a visible head: the default init is near 0 for every score
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    out = root / name
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {"reward": _hf_classifier(root, "reward", "sequence", 1),
            "three": _hf_classifier(root, "three", "sequence", 3),
            "value": _hf_classifier(root, "value", "token", 1)}


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = {name: ServerProcess(path, logs, "--is-embedding", wait=False) for name, path in models.items()}
    try:
        for s in started.values():
            s.wait_ready(120)
        yield started
    finally:
        for s in started.values():
            s.stop()


def post(url: str, body: object) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


SEQUENCES = [[5, 17, 40, 41, 42, 9], [3, 11], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 33]]


def _hf_scores(path: Path, kind: str, sequences: list[list[int]]) -> list[list[float]]:
    cls = {"sequence": transformers.AutoModelForSequenceClassification,
           "token": transformers.AutoModelForTokenClassification}[kind]
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in sequences:  # one at a time: no padding, the score at the last token
            logits = model(torch.tensor([ids])).logits[0]
            out.append((logits if kind == "sequence" else logits[-1]).tolist())
    return out


@pytest.mark.parametrize(("name", "kind"), [("reward", "sequence"), ("three", "sequence"), ("value", "token")])
def test_scores_equal_transformers_forward(servers, models, name, kind):
    """One request with three sequences of different lengths (one forward, packed): each sequence's
    `embedding` equals transformers' logits at its last token (a token classifier's last row)
    within 1e-5; one sequence alone is answered as one object, the same score."""
    want = _hf_scores(models[name], kind, SEQUENCES)
    status, got = post(servers[name].url + "/classify", {"input_ids": SEQUENCES})
    assert status == 200, got
    assert [item["meta_info"]["prompt_tokens"] for item in got] == [len(s) for s in SEQUENCES]
    for item, expected in zip(got, want, strict=True):
        assert len(item["embedding"]) == len(expected)
        assert max(abs(a - b) for a, b in zip(item["embedding"], expected, strict=True)) < TOL, (item, expected)
    status, one = post(servers[name].url + "/classify", {"input_ids": SEQUENCES[1], "rid": "r1"})
    assert status == 200 and one["meta_info"]["id"] == "r1"
    assert max(abs(a - b) for a, b in zip(one["embedding"], want[1], strict=True)) < TOL


def test_text_is_encoded_with_the_models_tokenizer(servers, models):
    tokenizer = transformers.AutoTokenizer.from_pretrained(models["reward"])
    texts = ["3 + 5 = 8", "the answer is \\boxed{12}"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    status, got = post(servers["reward"].url + "/classify", {"text": texts})
    assert status == 200, got
    for item, expected in zip(got, _hf_scores(models["reward"], "sequence", ids), strict=True):
        assert abs(item["embedding"][0] - expected[0]) < TOL


def test_v1_classify_answers_vllms_shape(servers, models):
    """vLLM's classification API: probs are the softmax of the label scores (a one-label reward
    model's: the sigmoid of its score), the label the most probable one by the config's names."""
    want = torch.tensor(_hf_scores(models["three"], "sequence", SEQUENCES), dtype=torch.float64)
    status, got = post(servers["three"].url + "/v1/classify", {"model": "any", "input": SEQUENCES})
    assert status == 200, got
    assert got["object"] == "list" and got["usage"]["prompt_tokens"] == sum(map(len, SEQUENCES))
    names = ["bad", "fine", "good"]
    for i, (item, scores) in enumerate(zip(got["data"], want, strict=True)):
        probs = torch.softmax(scores, dim=-1)
        assert item["index"] == i and item["num_classes"] == 3 and item["label"] == names[int(probs.argmax())]
        assert max(abs(a - b) for a, b in zip(item["probs"], probs.tolist(), strict=True)) < TOL
    reward = _hf_scores(models["reward"], "sequence", SEQUENCES[:1])[0][0]
    status, got = post(servers["reward"].url + "/v1/classify", {"input": SEQUENCES[0]})
    assert status == 200 and got["data"][0]["num_classes"] == 1
    assert abs(got["data"][0]["probs"][0] - float(torch.sigmoid(torch.tensor(reward, dtype=torch.float64)))) < TOL


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/classify", {}, "send 'text'"),
    ("/classify", {"text": "a", "input_ids": [1]}, "one of them"),
    ("/classify", {"input_ids": []}, "field 'input_ids' must be"),
    ("/classify", {"input_ids": [[1, 2], []]}, "sequence 1 is empty"),
    ("/classify", {"input_ids": [1, 99999]}, "token id 99999, outside the vocabulary"),
    ("/classify", {"input_ids": [1, True]}, "field 'input_ids' must be"),
    ("/classify", {"input_ids": [1] * 40000}, "more than the model's context"),
    ("/classify", {"input_ids": [[1] * 2000] * 5}, "more than one forward takes"),
    ("/v1/classify", {"model": "m"}, "field 'input' is required"),
    ("/v1/classify", {"input": 7}, "field 'input' must be"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, "serves a sequence classifier"),
    ("/update_weights_from_disk", {"model_path": "x"}, "serves a sequence classifier"),
])
def test_bad_input_gets_a_400_naming_it(servers, path, body, message):
    status, got = post(servers["reward"].url + path, body)
    assert status == 400, got
    assert message in json.dumps(got), got


def test_a_causal_lm_is_refused_as_a_classifier_and_the_reverse(servers, tmp_path):
    """--is-embedding on a causal LM: the server reports why it cannot serve it on /health (503)
    and its log; /classify on a generating server: 400."""
    lm = init_model(tmp_path / "lm", preset="tiny", seed=0)
    server = ServerProcess(lm, tmp_path, "--is-embedding", wait_healthy=False)
    try:
        for _ in range(600):  # bounded: the engine loads in a few seconds
            req = urllib.request.Request(server.url + "/health")
            try:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5)
            except urllib.error.HTTPError as err:
                body = json.loads(err.read())
                if body.get("status") == "broken":
                    assert "not a classifier: --is-embedding serves" in body["message"], body
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("the server never reported the causal LM refused")
    finally:
        server.stop()
    generating = ServerProcess(lm, tmp_path)
    try:
        status, got = post(generating.url + "/classify", {"input_ids": [1, 2]})
        assert status == 400 and "needs a classifier served with --is-embedding" in json.dumps(got), got
    finally:
        generating.stop()
