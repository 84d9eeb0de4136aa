"""CUDA IPC handles are pickles read by the server: only what torch's reduction of a CUDA tensor
contains may be resolved, so a forged handle cannot run code (checked on CPU; the handle below has
the exact structure `reduce_tensor` gives a CUDA tensor, with CPU stand-ins for its handles)."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from tandem.weights.shm import ShmError, load_cuda_ipc_handle


def _like_reduce_tensor(dtype: torch.dtype) -> tuple:
    """What `reduce_tensor` returns for a CUDA uint8/bf16 buffer (torch 2.x, its CUDA branch)."""
    t = torch.empty(16, dtype=dtype)
    return (rebuild_cuda_tensor, (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, 0,
                                  b"\x07" * 64, 16 * t.element_size(), 0, False, b"/torch_ref", 0, b"\x00" * 64,
                                  True))


def _encode(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_a_real_handle_is_read(dtype):
    want = _like_reduce_tensor(dtype)
    rebuild, args = load_cuda_ipc_handle(_encode(want))
    assert rebuild is rebuild_cuda_tensor and args == want[1]


class _RunsCode:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_forged_handle_is_refused_without_running_it(tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(ShmError, match=r"not (posix|os|nt)\.mkdir"):
        load_cuda_ipc_handle(_encode(_RunsCode(str(target))))
    assert not target.exists()
    with pytest.raises(ShmError, match=r"not builtins\.eval"):  # hidden inside an allowed structure
        load_cuda_ipc_handle(_encode((rebuild_cuda_tensor, (eval,))))


def test_malformed_handles_name_the_field():
    with pytest.raises(ShmError, match="cuda_ipc is not base64"):
        load_cuda_ipc_handle("not base64 at all!")
    with pytest.raises(ShmError, match="cuda_ipc is not a CUDA IPC handle"):
        load_cuda_ipc_handle(base64.b64encode(b"\x80\x04garbage").decode())
    with pytest.raises(ShmError, match="expected torch's rebuild_cuda_tensor"):
        load_cuda_ipc_handle(_encode((torch.Size, ((1, 2),))))
