"""The serving engine's device is the one its tensors report: `LLMEngine(device="cuda")` means
"cuda:N", so comparisons with a tensor's device hold (the weight receiver reuses a staging buffer
only when its device equals the engine's; with "cuda" vs "cuda:0" it reallocated every bucket)."""

from __future__ import annotations

import torch

from tandem.inference.engine import LLMEngine


def test_the_engine_device_is_the_one_its_tensors_report(model_dir, device):
    engine = LLMEngine(model_dir, device=device.type, kv_cache_tokens=256)
    made_there = torch.empty(1, device=engine.device).device
    assert engine.device == made_there, (engine.device, made_there)
    assert engine.runner.kv_cache.device == engine.device
