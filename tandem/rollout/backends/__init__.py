"""Backend adapters: `native` (Tandem, SGLang) and `vllm`."""

from __future__ import annotations

from tandem.rollout.backends.base import Backend, parse_version
from tandem.rollout.backends.native import NativeBackend
from tandem.rollout.backends.vllm import VLLMBackend


def get_backend(name: str, **kwargs) -> Backend:
    if name in ("native", "tandem", "sglang"):
        return NativeBackend()
    if name == "vllm":
        return VLLMBackend(**kwargs)
    raise ValueError(f"unknown inference backend {name!r}; use 'native' (tandem, sglang) or 'vllm'")


__all__ = ["Backend", "NativeBackend", "VLLMBackend", "get_backend", "parse_version"]
