"""Building and loading the CPU kernels: reused builds, the off switch, and a failed build's
logged fallback (the kernels' results: tests/inference/test_paged_attention.py)."""

from __future__ import annotations

import logging

import pytest
from torch.utils import cpp_extension

from tandem.inference import cpu_kernels


def _no_builds(*args, **kwargs):
    raise RuntimeError("Error building extension: g++: command not found")


def test_a_finished_build_is_loaded_without_building(monkeypatch):
    assert cpu_kernels.paged_attention() is not None  # built here (or earlier) into the default cache
    monkeypatch.setattr(cpp_extension, "load", _no_builds)
    module = cpu_kernels.paged_attention.__wrapped__()
    assert module is not None and hasattr(module, "attend")


def test_the_off_switch(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert cpu_kernels.paged_attention.__wrapped__() is None


def test_a_failed_build_falls_back_saying_how_to_fix_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))  # no finished build there
    monkeypatch.setattr(cpp_extension, "load", _no_builds)
    with caplog.at_level(logging.WARNING, logger="tandem.inference.cpu_kernels"):
        assert cpu_kernels.paged_attention.__wrapped__() is None
    assert "g++: command not found" in caplog.text and "make test-deps" in caplog.text
    assert "TANDEM_CPU_KERNELS=0" in caplog.text


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_switch_values(monkeypatch, value):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", value)
    assert not cpu_kernels.enabled()


def test_a_cpu_engine_readies_the_sampler_kernel_at_start(monkeypatch, qwen3_dir):
    """Catches the sampler's kernel being built inside the first request's step (~20 s of g++ on a
    fresh machine, against that request's deadline) instead of while the engine starts."""
    from tandem.inference.engine import LLMEngine

    calls = []
    monkeypatch.setattr(cpu_kernels, "sampler", lambda: calls.append(1))
    LLMEngine(qwen3_dir, kv_cache_tokens=256, block_size=16)
    assert calls, "LLMEngine did not build or load the sampler kernel while starting"
