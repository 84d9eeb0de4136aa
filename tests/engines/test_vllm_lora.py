"""vLLM's CPU build serving PEFT adapters through its own LoRA support (`VLLMServerSpec.lora_rank`:
`--enable-lora`, `/v1/load_lora_adapter`; `tandem.weights.vllm_lora.load_adapter`), against
transformers + peft as the oracle (fp32): the logprobs of the tokens vLLM samples with an adapter
equal peft's; an update under the same name from a new directory takes effect at once; a failed
load leaves the served adapter alone; and vLLM 0.32's prefix cache after a reload from the same
path, which is why every version needs a directory of its own."""

from __future__ import annotations

import shutil
import statistics
import time
import uuid
from pathlib import Path

import peft
import pytest
import torch
import transformers

from tandem.fleet import ops
from tandem.fleet.adapters import VLLMAdapter
from tandem.fleet.generation import GenerationParams
from tandem.fleet.http import HttpFleet
from tandem.launch import vllm
from tandem.launch.process import free_port
from tandem.rollout.types import ModelRequest, ModelResponse
from tandem.rollout.version import WeightVersion
from tandem.weights.report import WeightSyncError
from tandem.weights.vllm_lora import load_adapter
from tests.engines.conftest import MODEL_NAME, VLLMServer
from tests.engines.test_vllm import PROMPTS, client_for, generate

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
POLICY = "policy"  # the adapter's served name, as a LoRA run would name it
EXACT = 1e-5
APART = 0.1  # the adapters move the sampled tokens' logprobs by ~0.5 (measured); equal ones fail this


def make_adapter(base: Path, out: Path, seed: int, rank: int = RANK) -> Path:
    """A PEFT LoRA adapter of `base` with lora_B drawn at random (PEFT starts it at zero, which
    would leave the model unchanged), saved in PEFT's format."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


def fresh_copy(adapter: Path, root: Path) -> Path:
    """The adapter's files in a directory no load has used (`load_adapter`'s contract)."""
    return Path(shutil.copytree(adapter, root / uuid.uuid4().hex))


@torch.no_grad()
def peft_logprobs(model: torch.nn.Module, r: ModelResponse, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the sampled tokens, teacher forced through `model`."""
    ids = torch.tensor([r.input_ids + r.output_ids])
    logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(r.input_ids) - 1, ids.shape[1] - 1)
    return torch.log_softmax(logits / temperature, dim=-1)[positions, torch.tensor(r.output_ids)]


def worst(model: torch.nn.Module, responses: list[ModelResponse], temperature: float) -> float:
    return max((torch.tensor(r.output_logprobs) - peft_logprobs(model, r, temperature)).abs().max().item()
               for r in responses)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, small_model, vllm_python_path):
    spec = vllm.VLLMServerSpec(vllm_python_path, str(small_model), free_port(), served_model_name=MODEL_NAME,
                               threads=1, max_model_len=4096, lora_rank=RANK, max_loras=2)
    began = time.monotonic()
    proc = vllm.start(spec, tmp_path_factory.mktemp("vllm-lora") / "server.log", timeout_s=300)
    print(f"vLLM server with LoRA healthy after {time.monotonic() - began:.1f}s")
    try:
        yield VLLMServer(spec.url, small_model, MODEL_NAME)
    finally:
        vllm.stop(proc)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, small_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"v1": make_adapter(small_model, root / "v1", 1), "v2": make_adapter(small_model, root / "v2", 2),
            "rank16": make_adapter(small_model, root / "rank16", 3, rank=16)}


@pytest.fixture(scope="module")
def oracles(small_model, adapters) -> dict[str, torch.nn.Module]:
    """transformers' model of the checkpoint, bare and with each adapter (peft), fp32."""
    def base() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32).eval()
    return {"base": base(), **{k: peft.PeftModel.from_pretrained(base(), adapters[k]).eval() for k in ("v1", "v2")}}


def as_served(server: VLLMServer, name: str) -> VLLMServer:
    return VLLMServer(server.url, server.model, name)


def sample(server: VLLMServer, name: str, temperature: float = 1.0, version: int = 0,
           prompts: tuple[list[int], ...] = PROMPTS) -> list[ModelResponse]:
    params = GenerationParams(max_new_tokens=24, temperature=temperature, ignore_eos=True)
    got = generate(client_for(as_served(server, name), WeightVersion(version)),
                   [ModelRequest(list(p), params) for p in prompts])
    assert all(len(r.output_ids) == 24 for r in got)
    return got


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_adapter_logprobs_equal_peft(lora_server, adapters, oracles, tmp_path, temperature):
    """Requests naming the adapter sample from base + adapter: their logprobs equal peft's (and
    are far from the base model's); requests naming the base model still get the base model."""
    load_adapter(lora_server.url, POLICY, fresh_copy(adapters["v1"], tmp_path))
    got = sample(lora_server, POLICY, temperature)
    error, off = worst(oracles["v1"], got, temperature), worst(oracles["base"], got, temperature)
    base_error = worst(oracles["base"], sample(lora_server, MODEL_NAME, temperature), temperature)
    print(f"T={temperature}: max |vLLM - peft| {error:.2e} with the adapter ({off:.2f} from the base model); "
          f"base model {base_error:.2e}")
    assert error < EXACT and off > APART and base_error < EXACT


def test_an_update_under_the_same_name_takes_effect(lora_server, adapters, oracles, tmp_path):
    """Each version loads from a new directory under the same name, between pause and resume, the
    version set after it (as a full update): the next requests sample from the new adapter and carry
    its version. Prints the time of one adapter load and of one full-weights load from disk."""
    loads, fulls = [], []
    with HttpFleet([lora_server.url], adapter=VLLMAdapter(POLICY)) as fleet:
        for version, key in ((1, "v1"), (2, "v2"), (3, "v1"), (4, "v2")):
            path = fresh_copy(adapters[key], tmp_path)
            fleet.send(ops.PAUSE, ops.PauseGeneration()).result(30)
            began = time.perf_counter()
            load_adapter(lora_server.url, POLICY, path)
            loads.append(time.perf_counter() - began)
            fleet.send(ops.SET_VERSION, ops.SetVersion(version)).result(30)
            fleet.send(ops.CONTINUE, ops.ContinueGeneration()).result(30)
            got = sample(lora_server, POLICY, version=version)
            other = oracles["v2" if key == "v1" else "v1"]
            assert all(r.output_versions == [version] * 24 for r in got)
            assert worst(oracles[key], got, 1.0) < EXACT and worst(other, got, 1.0) > APART, version
        for _ in range(4):  # the base checkpoint again, in place: what a full update's commit costs vLLM
            began = time.perf_counter()
            fleet.send(ops.LOAD_DISK, ops.DiskLoad(str(lora_server.model))).result(120)
            fulls.append(time.perf_counter() - began)
    assert worst(oracles["v2"], sample(lora_server, POLICY), 1.0) < EXACT  # the base reload kept the adapter
    print(f"adapter load {statistics.median(loads) * 1e3:.1f} ms (median of {len(loads)}; "
          f"{sum(p.stat().st_size for p in adapters['v1'].iterdir()) / 1e6:.2f} MB on disk), "
          f"full-weights reload {statistics.median(fulls) * 1e3:.1f} ms "
          f"({sum(p.stat().st_size for p in lora_server.model.glob('*.safetensors')) / 1e6:.1f} MB)")


def test_a_failed_load_leaves_the_adapter_served(lora_server, adapters, oracles, tmp_path):
    """No adapter in the directory, or one of a rank above the server's: WeightSyncError naming
    vLLM's reason, and the name keeps serving the adapter it served."""
    load_adapter(lora_server.url, POLICY, fresh_copy(adapters["v1"], tmp_path))
    with pytest.raises(WeightSyncError, match="No adapter found") as missing:
        load_adapter(lora_server.url, POLICY, tmp_path / "nothing-here")
    with pytest.raises(WeightSyncError, match="rank") as too_big:
        load_adapter(lora_server.url, POLICY, fresh_copy(adapters["rank16"], tmp_path))
    print(f"refused: {missing.value}; {too_big.value}")
    assert missing.value.phase == too_big.value.phase == "load_adapter"
    assert worst(oracles["v1"], sample(lora_server, POLICY), 1.0) < EXACT


def test_a_reload_from_the_same_path_meets_the_prefix_cache(lora_server, adapters, oracles, tmp_path):
    """vLLM 0.32 keys an adapter's cached KV blocks by (name, path): new files loaded from the same
    path serve a prompt it cached with the old adapter's KV (neither adapter's logprobs), while an
    uncached prompt gets the new adapter. `load_adapter` asks for a new directory per version for
    this reason; if this fails, vLLM no longer reuses them and that rule could go."""
    path = fresh_copy(adapters["v1"], tmp_path)
    long_prompt = ([(7 * i + 3) % 2000 for i in range(300)],)  # several full KV blocks, so cached
    load_adapter(lora_server.url, "stale", path)
    assert worst(oracles["v1"], sample(lora_server, "stale", prompts=long_prompt), 1.0) < EXACT
    shutil.rmtree(path)
    shutil.copytree(adapters["v2"], path)
    load_adapter(lora_server.url, "stale", path)
    cached = sample(lora_server, "stale", prompts=long_prompt)
    assert worst(oracles["v2"], cached, 1.0) > APART and worst(oracles["v1"], cached, 1.0) > APART
    assert worst(oracles["v2"], sample(lora_server, "stale"), 1.0) < EXACT
