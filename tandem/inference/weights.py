"""Weight updates for a serving model: validate the whole set, then swap (all or nothing)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from tandem.errors import CheckpointError
from tandem.inference.errors import WeightUpdateError
from tandem.models.finite import non_finite
from tandem.weights.verify import tensor_checksum

_NATIVE: weakref.WeakKeyDictionary[nn.Module, tuple[object, dict[str, torch.Tensor]]] = weakref.WeakKeyDictionary()


def _native_params(model: nn.Module) -> tuple[object, dict[str, torch.Tensor]]:
    """(state-dict adapter, native name -> parameter; tied weights appear once), made once per
    model: walking the modules costs ~0.3 ms for a 500M model, paid by every bucket of an update
    otherwise. Parameters keep their identity for a model's life (updates rebind `.data`)."""
    known = _NATIVE.get(model)
    if known is None:
        known = _NATIVE[model] = (model.spec.state_dict_adapter_cls(model.args), dict(model.named_parameters()))
    return known


def stage_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                  strict_dtype: bool = True, partial: bool = False) -> dict[str, torch.Tensor]:
    """Check a full set of HF-named tensors against `model`; -> native name -> tensor.

    Every parameter must be present exactly once with its shape; with `strict_dtype` its dtype too
    (else any floating dtype, cast when copied); every value finite (meta tensors, which carry no
    values, pass). `partial` checks one bucket of a staged update: the same rules except that
    parameters may be missing. Raises WeightUpdateError naming the first bad tensor. Every weight
    update goes through here before its swap, so this is the one finiteness check of updates.
    """
    adapter, params = _native_params(model)
    staged: dict[str, torch.Tensor] = {}
    for hf_name, tensor in weights:
        try:
            native = adapter.hf_to_native(hf_name)
        except CheckpointError:
            native = ""
        if native is None:
            continue  # known and harmless (a tied lm_head, stale rotary buffers)
        if native not in params:
            raise WeightUpdateError(f"weight update has unknown tensor {hf_name!r} for {model.args.model_type}")
        if native in staged:
            raise WeightUpdateError(f"weight update sends tensor {hf_name!r} twice")
        param = params[native]
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightUpdateError(
                f"weight update tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        if (strict_dtype and tensor.dtype != param.dtype) or not tensor.is_floating_point():
            raise WeightUpdateError(
                f"weight update tensor {hf_name!r} has dtype {tensor.dtype}, expected {param.dtype}"
            )
        if (what := non_finite(tensor)) is not None:
            raise WeightUpdateError(f"weight update tensor {hf_name!r} holds {what} values")
        staged[native] = tensor
    absent = () if partial else params.keys() - staged.keys()
    if absent:
        missing = sorted(adapter.native_to_hf(n) for n in absent)
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
def swap_weights(model: nn.Module, staged: dict[str, torch.Tensor]) -> bool:
    """Put `staged` into the parameters. When EVERY staged tensor is marked adoptable
    (`mark_adoptable`) and has its parameter's dtype and device, the parameters are rebound to
    those tensors (no copy; a server's ping-pong staging buffers or zero-copy segments) and each is
    marked `ADOPTED`; otherwise every tensor is copied in place (cast when dtypes differ), except
    into a parameter living in shared memory, which gets fresh memory of its own instead (so the
    mapping goes and the writer's pages are never touched). -> whether adopted."""
    _, params = _native_params(model)
    adopt = bool(staged) and all(getattr(t, ADOPT, False) and t.dtype == params[n].dtype
                                 and t.device == params[n].device for n, t in staged.items())
    retired: list[torch.Tensor] = []
    for name, tensor in staged.items():
        param = params[name]
        if adopt:
            if getattr(param, SHARED, False):
                retired.append(param.data)
            param.data = tensor
            setattr(tensor, ADOPTED, True)
            setattr(param, SHARED, getattr(tensor, ADOPT) == "shared")
        elif getattr(param, SHARED, False):
            param.data = tensor.to(dtype=param.dtype, device=param.device, copy=True)
            setattr(param, SHARED, False)
        else:
            param.copy_(tensor)
    if retired:
        _release_in_background(retired)
    return adopt


def _release_in_background(tensors: list[torch.Tensor]) -> None:
    """Drop the last references to parameters that lived in shared-memory mappings on a thread of
    their own: unmapping a model's worth of pages takes tens of milliseconds (1 GB: ~25 ms), which
    the swap (and the generation it holds up) need not wait for."""
    threading.Thread(target=tensors.clear, name="tandem-unmap", daemon=True).start()


def weight_checksums(model: nn.Module, hf_names: Iterable[str] | None = None) -> dict[str, str]:
    """HF name -> sha256 (hex) of the parameter's bytes as served (its dtype, C order); all
    parameters when `hf_names` is None. The trainer hashes its tensors cast to the same dtype."""
    adapter, params = _native_params(model)
    names = {adapter.native_to_hf(n): n for n in params}
    wanted = list(names) if hf_names is None else list(hf_names)
    out = {}
    for hf_name in wanted:
        if hf_name not in names:
            raise WeightUpdateError(f"no parameter named {hf_name!r}")
        out[hf_name] = tensor_checksum(params[names[hf_name]])
    return out


def get_weight(model: nn.Module, hf_name: str, truncate_size: int = 100) -> list[float]:
    """The first `truncate_size` elements (flattened) of one parameter, by its HF name."""
    adapter, params = _native_params(model)
    try:
        native = adapter.hf_to_native(hf_name)
    except CheckpointError:
        native = None
    if native is None and hf_name == "lm_head.weight":
        native = "tok_embeddings.weight"  # tied: the head is the embedding
    if native not in params:
        raise WeightUpdateError(f"no parameter named {hf_name!r}")
    return params[native].detach().flatten()[:truncate_size].float().tolist()
