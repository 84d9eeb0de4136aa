"""The keys of how `tandem train` and `tandem sft` start their processes, loaded through the run
config and applied by the launcher (`tandem.rl.cluster.start_workers` / `start_servers`) with the
local scheduler: real trainer ranks, a real `tandem serve`, and a stand-in vLLM interpreter (a
real process that records what it was started with and answers /health, because vLLM itself is
not installed here). Each test reads what the started processes got: their CPU affinity, their
environment, their command line, what they answer."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tandem.launch import LaunchError, LocalScheduler
from tandem.rl.cluster import start_servers, start_workers
from tandem.rl.config import load_run_config
from tests.launch.procs import CHILD_ENV

pytestmark = pytest.mark.slow
CORE = min(os.sched_getaffinity(0))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}


def test_trainer_ranks_start_as_the_actor_keys_say(tmp_path, model_dir):
    """Catches `actor.cpus`, `actor.num_threads` or `scheduler.start_timeout_s` not reaching the
    trainer ranks' launch: the rank is pinned to the configured core and runs with the configured
    OMP_NUM_THREADS (the scheduler's own environment says 1); a start timeout shorter than a
    rank's start fails the launch, naming it."""
    cfg = load_run_config(None, [f"actor.path={model_dir}", "actor.backend=archon:d1", f"actor.cpus={CORE}",
                                 "actor.num_threads=3"])
    with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10) as scheduler:
        trainer = start_workers(cfg, scheduler)
        (rank,) = trainer.ping()
        assert rank.initialized
        assert os.sched_getaffinity(rank.pid) == {CORE}
        assert _environ(rank.pid)["OMP_NUM_THREADS"] == "3"
        trainer.shutdown()
    hurried = load_run_config(None, [f"actor.path={model_dir}", "actor.backend=archon:d1",
                                     "scheduler.start_timeout_s=0.01"])
    with LocalScheduler(tmp_path / "run2", env=CHILD_ENV, grace_s=10) as scheduler, \
            pytest.raises(LaunchError, match=r"actor-rank0 .* did not connect within the startup deadline"):
        start_workers(hurried, scheduler)


def test_launched_servers_take_the_rollout_keys(tmp_path, model_dir):
    """Catches `rollout.cpus`, `rollout.server_args` or `rollout.api_key` not reaching the launched
    `tandem serve`: it is pinned to the configured core, runs with the extra options (its
    /get_server_info reports them), and refuses requests without the configured key."""
    cfg = load_run_config(None, [f"actor.path={model_dir}", "rollout.backend=tandem:d1", f"rollout.cpus={CORE}",
                                 "rollout.server_args=[--max-num-seqs, '3', --num-threads, '1']",
                                 "rollout.api_key=the-runs-key"])
    with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10) as scheduler:
        servers = start_servers(cfg, scheduler, str(model_dir))
        (handle,) = servers.handles
        assert servers.api_key == "the-runs-key"
        assert os.sched_getaffinity(handle.pid) == {CORE}
        status, info = _get(handle.url + "/get_server_info", "the-runs-key")
        assert status == 200 and info["max_num_seqs"] == 3 and info["num_threads"] == 1, info
        assert _get(handle.url + "/get_server_info")[0] == 401
        assert _get(handle.url + "/get_server_info", "another-key")[0] == 401


FAKE_VLLM = textwrap.dedent("""\
    #!{python}
    # Stands in for a vLLM interpreter: records its arguments and environment, then answers /health
    # on --port (or, with TANDEM_FAKE_VLLM_SILENT set, never starts serving).
    import http.server, json, os, sys, time
    args = sys.argv[1:]
    with open({record!r}, "w") as f:
        json.dump({{"args": args, "env": dict(os.environ)}}, f)
    if os.environ.get("TANDEM_FAKE_VLLM_SILENT"):
        time.sleep(3600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
    """)


def test_launched_vllm_servers_take_the_vllm_keys(tmp_path, model_dir, monkeypatch):
    """Catches a `rollout.vllm.*` key (or `rollout.model`) not reaching the vLLM server Tandem
    starts: the configured interpreter runs it with --max-model-len, --served-model-name, the
    extra arguments, the worker extension and --enforce-eager as configured, VLLM_CPU_KVCACHE_SPACE and
    OMP_NUM_THREADS in its environment; a server that does not become healthy within
    start_timeout_s fails the launch."""
    record = tmp_path / "vllm.json"
    python = tmp_path / "fake-vllm-python"
    python.write_text(FAKE_VLLM.format(python=sys.executable, record=str(record)))
    python.chmod(0o755)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)

    def launch(*overrides: str) -> dict:
        cfg = load_run_config(None, [f"actor.path={model_dir}", "rollout.backend=vllm:d1", "train.weight_sync=disk",
                                     f"rollout.vllm.python={python}", *overrides])
        with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=5) as scheduler:
            servers = start_servers(cfg, scheduler, str(model_dir))
            assert len(servers.handles) == 1
        return json.loads(record.read_text())

    default = launch()
    configured = launch("rollout.vllm.max_model_len=321", "rollout.vllm.kv_cache_gib=3", "rollout.vllm.threads=2",
                        "rollout.vllm.args=[--seed, '7']", "rollout.vllm.worker_extension=false",
                        "rollout.vllm.enforce_eager=true", "rollout.model=policy")

    def option(run: dict, name: str) -> str | None:
        return run["args"][run["args"].index(name) + 1] if name in run["args"] else None

    assert (option(default, "--max-model-len"), option(configured, "--max-model-len")) == ("2048", "321")
    assert (option(default, "--served-model-name"), option(configured, "--served-model-name")) == (None, "policy")
    assert (option(default, "--seed"), option(configured, "--seed")) == (None, "7")
    assert "--worker-extension-cls" in default["args"] and "--worker-extension-cls" not in configured["args"]
    assert "--enforce-eager" not in default["args"] and "--enforce-eager" in configured["args"]  # compiled by default
    assert (default["env"]["VLLM_CPU_KVCACHE_SPACE"], configured["env"]["VLLM_CPU_KVCACHE_SPACE"]) == ("1", "3")
    assert configured["env"]["OMP_NUM_THREADS"] == "2" and default["env"]["OMP_NUM_THREADS"] != "2"
    # A LoRA run with disk sync: vLLM's LoRA support at the smallest --max-lora-rank that holds
    # actor.lora.rank, the base served under a name of its own (the adapter takes rollout.model)
    lora, named = launch("actor.lora.rank=4"), launch("actor.lora.rank=16", "rollout.model=pol")
    assert "--enable-lora" not in default["args"] and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in default["env"]
    assert [option(r, "--max-lora-rank") for r in (lora, named)] == ["8", "16"] and option(lora, "--max-loras") == "1"
    assert [option(r, "--served-model-name") for r in (lora, named)] == ["policy-base", "pol-base"]
    assert lora["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--enable-lora" not in launch("actor.lora.rank=4", "train.weight_sync=distributed")["args"]  # merged weights

    monkeypatch.setenv("TANDEM_FAKE_VLLM_SILENT", "1")
    with pytest.raises(RuntimeError, match=r"not healthy within 1s"):
        launch("rollout.vllm.start_timeout_s=1")
