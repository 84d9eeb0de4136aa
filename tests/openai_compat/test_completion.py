"""Completions answers and streams: legacy logprobs with real alternatives, deltas that add up."""

from __future__ import annotations

import pytest

from tandem.openai_compat import ChoiceOutput, CompletionStream, text_completion

openai = pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402


def output(tokenizer, text, index=0, k=2):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # the sampled token is the second most likely at even steps, the most likely at odd ones
    tops = [[(-0.5, t + 1), (-1.0, t)] if i % 2 == 0 else [(-1.0, t), (-2.0, t + 1)] for i, t in enumerate(ids)]
    return ChoiceOutput(index=index, output_ids=ids, text=text, logprobs=[-1.0] * len(ids),
                        top_logprobs=[t[:k] for t in tops], finish_reason="length", weight_version="2")


def test_text_completion_logprobs(tokenizer, token_text):
    out = output(tokenizer, "the cat sat", k=1)
    body = text_completion(id="cmpl-1", model="m", created=1, choices=[out], prompt_tokens=4, token_text=token_text,
                           weight_version="2", logprobs=1)
    parsed = Completion.model_validate(body)
    lp = parsed.choices[0].logprobs
    texts = [token_text(t) for t in out.output_ids]
    assert lp.tokens == texts and lp.token_logprobs == [-1.0] * len(texts) and "".join(texts) == "the cat sat"
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for i, (top, t) in enumerate(zip(lp.top_logprobs, out.output_ids, strict=True)):
        # the k = 1 most likely, plus the sampled token when it is not among them (OpenAI's rule)
        assert top == ({token_text(t + 1): -0.5, token_text(t): -1.0} if i % 2 == 0 else {token_text(t): -1.0})
    assert parsed.usage.prompt_tokens == 4 and parsed.usage.completion_tokens == len(texts)
    assert body["weight_version"] == "2" and body["choices"][0]["finish_reason"] == "length"
    assert text_completion(id="c", model="m", created=1, choices=[out], prompt_tokens=4, token_text=token_text,
                           weight_version=None, logprobs=None)["choices"][0]["logprobs"] is None


def test_completion_stream_adds_up(tokenizer, token_text):
    outs = [output(tokenizer, "two birds 日本 sang"), output(tokenizer, "one", index=1)]
    stream = CompletionStream("cmpl-1", "m", 1, token_text, 2, True, "2")
    chunks = []
    for o in outs:
        for i, t in enumerate(o.output_ids):
            chunks += stream.delta(o.index, [t], [o.logprobs[i]], [o.top_logprobs[i]],
                                   tokenizer.decode(o.output_ids[:i + 1]))
        chunks += stream.finish(o)
    chunks.append(stream.usage_chunk(3, sum(len(o.output_ids) for o in outs)))
    # the SDK's Completion model wants a finish_reason; chunks before the last have null (as OpenAI's)
    finals = [Completion.model_validate(c) for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f.choices[0].finish_reason for f in finals] == ["length", "length"]
    whole = text_completion(id="c", model="m", created=1, choices=outs, prompt_tokens=3, token_text=token_text,
                            weight_version="2", logprobs=2)
    for o, expected in zip(outs, whole["choices"], strict=True):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == o.index]
        assert "".join(c["text"] for c in mine) == o.text and all("\ufffd" not in c["text"] for c in mine)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == expected["logprobs"][key], key
        assert all(c["finish_reason"] is None for c in mine[:-1])
    last = Completion.model_validate({**chunks[-1], "choices": []})
    assert chunks[-1]["choices"] == [] and last.usage.total_tokens == 3 + sum(len(o.output_ids) for o in outs)
    assert all(c["object"] == "text_completion" for c in chunks)
