"""n samples of one prompt in one call to a real `tandem serve`, against n calls of one sample.

`InferenceClient.agenerate_samples` asks a tandem server for the n samples at once (the prompt
prefilled once, sample i seeded seed + i); a seeded run must draw exactly what n separate calls
seeded seed + i draw, or a resumed run's groups would change with the way they were sent. The
server runs `--batch-invariant`, so a sample's logits do not depend on its batch and the two paths
are compared bit for bit."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.rollout import GenerationParams, InferenceClient, ModelRequest
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import ServerProcess
from tests.rollout.conftest import run

pytestmark = pytest.mark.timeout(120)

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=0)
    proc = ServerProcess(model, tmp_path_factory.mktemp("serve"), "--batch-invariant")
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


def test_samples_in_one_call_equal_one_call_each(server):
    params = GenerationParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=1234)
    req = ModelRequest(PROMPT, params)

    async def both():
        client = InferenceClient([server.url])
        try:
            grouped = await client.agenerate_samples(req, 4)
            alone = [await client.agenerate(ModelRequest(PROMPT, dataclasses.replace(params, seed=1234 + i)))
                     for i in range(4)]
            return grouped, alone
        finally:
            await client.aclose()

    grouped, alone = run(both(), timeout=60)
    assert all(r.num_calls == 1 and r.finish_reason == "length" for r in grouped)
    assert len({tuple(r.output_ids) for r in grouped}) == 4  # four different draws
    for g, a in zip(grouped, alone, strict=True):
        assert g.output_ids == a.output_ids
        assert g.output_logprobs == a.output_logprobs  # bit-identical
        assert g.output_versions == a.output_versions
