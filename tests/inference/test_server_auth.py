"""`--api-key`: every route but /health needs the bearer token; 127.0.0.1 is the default bind."""

from __future__ import annotations

import pytest

from tests.inference.server_utils import ServerProcess, request

KEY = "s3cret"


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--kv-cache-tokens", "1024", api_key=KEY)
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("method, path", [("GET", "/get_model_info"), ("GET", "/get_server_info"),
                                          ("POST", "/generate"), ("POST", "/flush_cache"), ("GET", "/v1/models"),
                                          ("POST", "/update_weights_from_disk"), ("POST", "/pause_generation")])
def test_routes_need_the_key(server, method, path):
    assert server.url.startswith("http://127.0.0.1:")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, body = request(server.url, method, path, {}, headers=headers)
        assert status == 401, (path, headers)
        assert body["code"] == 401 and "API key" in body["message"]


def test_health_is_open_and_the_key_works(server):
    assert request(server.url, "GET", "/health")[0] == 200
    out = server.ok("/generate", {"input_ids": [11, 12], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["completion_tokens"] == 2
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    assert client.completions.create(model="m", prompt=[11, 12], max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()
