"""Weight updates for a serving model: validate the whole set, then swap (all or nothing)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.errors import CheckpointError
from tandem.inference.errors import WeightUpdateError
from tandem.models.finite import non_finite
from tandem.models.state_dict_adapter import piece_shape
from tandem.weights.verify import tensor_checksum

Key = tuple[str, int | None]  # (native name, piece index along dim 0 or None): one HF tensor of the model


@dataclass(frozen=True)
class _Known:
    """A model's parameters and HF tensors, made once per model."""

    adapter: object
    params: dict[str, torch.Tensor]  # native name -> parameter (tied weights once)
    pieces: dict[str, Key]  # HF name -> (native, index), every HF tensor the model is made of


_NATIVE: weakref.WeakKeyDictionary[nn.Module, _Known] = weakref.WeakKeyDictionary()


def _known(model: nn.Module) -> _Known:
    """The model's `_Known`, made once per model: walking the modules costs ~0.3 ms for a 500M
    model, paid by every bucket of an update otherwise. Parameters keep their identity for a
    model's life (updates rebind `.data`)."""
    known = _NATIVE.get(model)
    if known is None:
        adapter = model.spec.state_dict_adapter_cls(model.args)
        params = dict(model.named_parameters())
        pieces = {hf: (name, index) for name, p in params.items() for hf, index in adapter.pieces(name, p.shape)}
        known = _NATIVE[model] = _Known(adapter, params, pieces)
    return known


def stage_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                  strict_dtype: bool = True, partial: bool = False) -> dict[Key, torch.Tensor]:
    """Check a full set of HF-named tensors against `model`; -> (native name, piece index) ->
    tensor, one entry per HF tensor (a stacked expert parameter is several: its pieces).

    Every HF tensor of the model must be present exactly once with its shape; with `strict_dtype`
    its dtype too (else any floating dtype, cast when copied); every value finite (meta tensors,
    which carry no values, pass). `partial` checks one bucket of a staged update: the same rules
    except that tensors may be missing. Raises WeightUpdateError naming the first bad tensor. Every
    weight update goes through here before its swap, so this is the one finiteness check of updates.
    """
    known = _known(model)
    staged: dict[Key, torch.Tensor] = {}
    for hf_name, tensor in weights:
        try:
            piece = known.adapter.hf_to_piece(hf_name)
        except CheckpointError:
            piece = ("", None)
        if piece is None:
            continue  # known and harmless (a tied lm_head, stale rotary buffers)
        if known.pieces.get(hf_name) != piece:
            raise WeightUpdateError(f"weight update has unknown tensor {hf_name!r} for {model.args.model_type}")
        if piece in staged:
            raise WeightUpdateError(f"weight update sends tensor {hf_name!r} twice")
        param = known.params[piece[0]]
        shape = piece_shape(param.shape, piece[1])
        if tuple(tensor.shape) != tuple(shape):
            raise WeightUpdateError(
                f"weight update tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        if (strict_dtype and tensor.dtype != param.dtype) or not tensor.is_floating_point():
            raise WeightUpdateError(
                f"weight update tensor {hf_name!r} has dtype {tensor.dtype}, expected {param.dtype}"
            )
        if (what := non_finite(tensor)) is not None:
            raise WeightUpdateError(f"weight update tensor {hf_name!r} holds {what} values")
        staged[piece] = tensor
    if not partial and len(staged) != len(known.pieces):
        missing = sorted(hf for hf, key in known.pieces.items() if key not in staged)
        raise WeightUpdateError(f"weight update is missing tensor(s): {', '.join(missing)}")
    return staged


ADOPT = "_tandem_adopt"  # set on a staged tensor the model may keep as its parameter's storage
ADOPTED = "_tandem_adopted"  # set by `swap_weights` on tensors it did keep
SHARED = "_tandem_shared"  # set on a parameter whose storage is another process's memory


def mark_adoptable(tensor: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """Let `swap_weights` keep `tensor` as a parameter's storage; `shared`: that storage is memory
    another process wrote (a zero-copy shared-memory segment), which is never written in place."""
    setattr(tensor, ADOPT, "shared" if shared else "own")
    return tensor


@torch.no_grad()
def swap_weights(model: nn.Module, staged: dict[Key, torch.Tensor]) -> bool:
    """Put `staged` (from `stage_weights`) into the parameters. When EVERY parameter can keep its
    staged memory, the parameters are rebound to it (no copy; a server's ping-pong staging
    buffers or zero-copy segments) and each staged tensor is marked `ADOPTED`: a whole tensor must
    be marked adoptable (`mark_adoptable`) with its parameter's dtype and device; a stacked
    parameter's pieces must all be, and lie back to back in one storage, in order (as a bucket
    packs them), so the parameter is one contiguous view over them. Otherwise every tensor is
    copied in place (cast when dtypes differ), except into a parameter living in shared memory,
    which gets fresh memory of its own first (so the mapping goes and the writer's pages are never
    touched). -> whether adopted."""
    params = _known(model).params
    grouped: dict[str, dict[int | None, torch.Tensor]] = {}
    for (name, index), tensor in staged.items():
        grouped.setdefault(name, {})[index] = tensor
    views = {name: _adoptable(params[name], pieces) for name, pieces in grouped.items()}
    adopt = bool(views) and all(v is not None for v in views.values())
    retired: list[torch.Tensor] = []
    for name, pieces in grouped.items():
        param = params[name]
        if adopt:
            if getattr(param, SHARED, False):
                retired.append(param.data)
            param.data = views[name]
            for tensor in pieces.values():
                setattr(tensor, ADOPTED, True)
            setattr(param, SHARED, getattr(next(iter(pieces.values())), ADOPT) == "shared")
            continue
        if getattr(param, SHARED, False):
            whole = pieces.get(None)
            param.data = (whole if whole is not None else param.data).to(dtype=param.dtype, device=param.device,
                                                                          copy=True)
            setattr(param, SHARED, False)
            if whole is not None:
                continue
        for index, tensor in pieces.items():
            (param if index is None else param[index]).copy_(tensor)
    if retired:
        _release_in_background(retired)
    return adopt


def _adoptable(param: torch.Tensor, pieces: dict[int | None, torch.Tensor]) -> torch.Tensor | None:
    """What `param` can be rebound to without a copy: its whole staged tensor, or one contiguous
    view over its back-to-back pieces; None when it cannot (unmarked, another dtype or device,
    pieces apart, or not all of them staged)."""
    tensors = list(pieces.values())
    if not all(getattr(t, ADOPT, False) and t.dtype == param.dtype and t.device == param.device
               for t in tensors):
        return None
    whole = pieces.get(None)
    if whole is not None:
        return whole
    if sorted(pieces) != list(range(param.shape[0])):
        return None
    first = pieces[0]
    step = first.numel()
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and t.storage_offset() == first.storage_offset() + i * step for i, t in sorted(pieces.items())):
        return None
    return first.as_strided(param.shape, param.new_empty(param.shape, device="meta").stride(), first.storage_offset())


def _release_in_background(tensors: list[torch.Tensor]) -> None:
    """Drop the last references to parameters that lived in shared-memory mappings on a thread of
    their own: unmapping a model's worth of pages takes tens of milliseconds (1 GB: ~25 ms), which
    the swap (and the generation it holds up) need not wait for."""
    threading.Thread(target=tensors.clear, name="tandem-unmap", daemon=True).start()


def weight_checksums(model: nn.Module, hf_names: Iterable[str] | None = None) -> dict[str, str]:
    """HF name -> sha256 (hex) of that HF tensor's bytes as served (the parameter, or its piece;
    its dtype, C order); every HF tensor of the model when `hf_names` is None. The trainer hashes
    its tensors cast to the same dtype."""
    known = _known(model)
    wanted = list(known.pieces) if hf_names is None else list(hf_names)
    out = {}
    for hf_name in wanted:
        if hf_name not in known.pieces:
            raise WeightUpdateError(f"no parameter named {hf_name!r}")
        out[hf_name] = tensor_checksum(_served(known, hf_name))
    return out


def served_tensor(model: nn.Module, hf_name: str) -> torch.Tensor:
    """The parameter (or piece) that serves HF tensor `hf_name`; WeightUpdateError when none does."""
    known = _known(model)
    if hf_name not in known.pieces:
        raise WeightUpdateError(f"no parameter named {hf_name!r}")
    return _served(known, hf_name)


def _served(known: _Known, hf_name: str) -> torch.Tensor:
    name, index = known.pieces[hf_name]
    param = known.params[name]
    return param if index is None else param[index]


def get_weight(model: nn.Module, hf_name: str, truncate_size: int = 100) -> list[float]:
    """The first `truncate_size` elements (flattened) of one HF tensor (a parameter or a piece)."""
    known = _known(model)
    if hf_name not in known.pieces and hf_name == "lm_head.weight":
        hf_name = known.adapter.native_to_hf("tok_embeddings.weight")  # tied: the head is the embedding
    if hf_name not in known.pieces:
        raise WeightUpdateError(f"no parameter named {hf_name!r}")
    return _served(known, hf_name).detach().flatten()[:truncate_size].float().tolist()
