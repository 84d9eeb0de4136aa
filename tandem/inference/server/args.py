"""Server arguments: one dataclass, filled from the command line (`tandem serve ...`, defined in
tandem/cli.py so that other commands do not import torch)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = 32768
    block_size: int = 16
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None
    batch_invariant: bool = False  # a sequence's logits do not depend on the rest of its batch
    weight_sync_timeout: float = 120.0
    weights_dir: list[str] = field(default_factory=list)  # beside the model's: where disk updates may load from
    log_level: str = "warning"
    join: str | None = None  # a run directory: register with its controller once ready (`--join`)
    is_embedding: bool = False  # serve a sequence classifier (`ClassifierEngine`) instead of generating
    join_failed: bool = field(default=False, repr=False)  # set when the controller never accepted us

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def public(self) -> dict:
        """The arguments as reported by /get_server_info (the API key is never echoed)."""
        out = asdict(self)
        out["api_key"] = "***" if self.api_key else None
        out["served_model_name"] = self.model_name
        return out

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in vars(ns).items() if k in fields})
