"""Reading and writing Hugging Face model directories (config.json + safetensors), model-agnostic.

Tensors are read one at a time with `safe_open`, so a process never holds more of a checkpoint
than it asks for. Every failure a user can fix is a `CheckpointError` naming the path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tandem.errors import CheckpointError
from tandem.models.finite import non_finite

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# ---------------------------------------------------------------------------------------- reading


def model_dir(path: str | os.PathLike[str]) -> Path:
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"model path {str(root)!r} does not exist; pass an HF model directory")
    if not root.is_dir():
        raise CheckpointError(
            f"model path {str(root)!r} is not a directory; pass the directory holding config.json"
        )
    return root


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {str(file)!r}: {e}; restore or re-download it") from e


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed `config.json` of an HF model directory."""
    file = model_dir(path) / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"no {CONFIG_NAME} in {str(file.parent)!r}; is this an HF model directory?")
    config = _read_json(file)
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(file)!r} does not hold a JSON object")
    return config


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """Weight files of a directory: from the shard index when present, else `*.safetensors`."""
    root = model_dir(path)
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{str(index)!r} has no 'weight_map'; re-save the checkpoint")
        files = [root / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(
                    f"{str(index)!r} names shard {file.name!r}, which is missing from {str(root)!r}; "
                    "copy the complete checkpoint"
                )
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no safetensors weights in {str(root)!r} (expected {SINGLE_FILE_NAME} or {INDEX_NAME} + shards); "
            "convert .bin checkpoints to safetensors"
        )
    return files


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """`safe_open` whose failures (truncated file, garbage header) name the file."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except SafetensorError as e:
        raise CheckpointError(
            f"corrupt or truncated safetensors file {str(file)!r} ({e}); re-download or re-save it"
        ) from e


def read_tensor_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Name -> (shape, file) for every tensor, from the file headers only (no tensor data read)."""
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in safetensors_files(path):
        with open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in shapes:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {shapes[name][1]} and {file}")
                shapes[name] = (tuple(handle.get_slice(name).get_shape()), file)
    return shapes


def iter_hf_tensors(
    path: str | os.PathLike[str], names: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` one tensor at a time, file by file; only `names` when given.

    A floating-point tensor holding NaN or infinite values raises `CheckpointError` naming it and
    its file (a diverged run or a damaged save; loading it would serve or train on garbage)."""
    for file in safetensors_files(path):
        with open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118
                if names is None or name in names:
                    tensor = handle.get_tensor(name)
                    if (what := non_finite(tensor)) is not None:
                        raise CheckpointError(
                            f"tensor {name!r} in {str(file)!r} holds {what} values; the checkpoint is broken "
                            "(a diverged run or a damaged save): restore or re-save a good one"
                        )
                    yield name, tensor


# ---------------------------------------------------------------------------------------- writing


def save_hf_checkpoint(
    out_dir: str | os.PathLike[str],
    config: dict[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write an HF model directory atomically: everything goes to a temporary sibling that is
    renamed into place once complete, so a half-written checkpoint never has the final name.

    `config` is written as given except `dtype`/`torch_dtype`, set from the tensors. Tensors may
    live on any device; each shard is copied to CPU only while it is written.
    """
    if not tensors:
        raise ValueError("no tensors to save")
    return save_hf_checkpoint_stream(
        out_dir,
        config,
        tensors.items(),
        tokenizer_dir=tokenizer_dir,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


def save_hf_checkpoint_stream(
    out_dir: str | os.PathLike[str],
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """`save_hf_checkpoint` for `(name, tensor)` pairs produced one at a time (e.g. gathered from
    sharded parameters): only the shard being filled is held, as CPU copies, and the iterator is
    consumed exactly once, in order. Same files, shard split and config as `save_hf_checkpoint`."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise CheckpointError(f"{str(out)!r} exists and is not a directory; choose another output path")
        if any(out.iterdir()) and not overwrite:
            raise CheckpointError(
                f"{str(out)!r} is not empty; pass overwrite=True or choose another directory"
            )
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is normally world-readable
        dtypes = _write_weights(tmp, tensors, max_shard_bytes)
        _write_json(tmp / CONFIG_NAME, _with_dtype(config, dtypes))
        generation = {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}
        _write_json(tmp / GENERATION_CONFIG_NAME, generation)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_json(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _with_dtype(config: dict[str, Any], floating: Counter[torch.dtype]) -> dict[str, Any]:
    """`floating` counts the floating-point tensors per dtype; the most common one is declared."""
    config = dict(config)
    if floating:
        dtype = str(floating.most_common(1)[0][0]).removeprefix("torch.")
        # transformers >= 4.56 reads `dtype`; older readers (and vLLM/SGLang) read `torch_dtype`.
        config["dtype"] = config["torch_dtype"] = dtype
    return config


def _write_weights(
    root: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int
) -> Counter[torch.dtype]:
    """Greedy, in order: a shard is closed when the next tensor would overflow it; a tensor larger
    than the limit gets a shard of its own. Shards are written under provisional names and renamed
    once their count is known. Returns the count of floating tensors per dtype."""
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    floating: Counter[torch.dtype] = Counter()
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        file = root / f".shard-{len(files):05d}.safetensors"
        save_file(shard, str(file), metadata={"format": "pt"})
        file.chmod(0o644)  # safetensors writes owner-only files; servers may run as others
        weight_map.update(dict.fromkeys(shard, str(len(files))))
        files.append(file)
        shard.clear()

    for name, tensor in tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"tensor {name!r} given twice")
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        # Copy: breaks storage sharing between tensors (which safetensors refuses) and moves to CPU.
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += nbytes
        total += nbytes
        if tensor.is_floating_point():
            floating[tensor.dtype] += 1
    if shard:
        flush()
    if not files:
        raise ValueError("no tensors to save")
    names = [
        SINGLE_FILE_NAME if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        for i in range(1, len(files) + 1)
    ]
    for file, name in zip(files, names, strict=True):
        file.rename(root / name)
    if len(files) > 1:
        weight_map = {n: names[int(i)] for n, i in weight_map.items()}
        _write_json(root / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return floating


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise CheckpointError(f"tokenizer directory {str(src)!r} does not exist")
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not copied:
        raise CheckpointError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {str(src)!r}")
    for name in copied:
        shutil.copy2(src / name, dst / name)


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
