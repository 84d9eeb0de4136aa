"""Shared-memory buckets for inference servers on the trainer's host (data plane only).

An update's buckets lie back to back in a /dev/shm segment (`tandem-w-<pid>-...`), each tensor at
an `ALIGN`-byte offset (`layout`, `pack`: the flat layout of a distributed bucket). Trainer rank 0
writes them (`ShmWriter`); a server maps the announced window (`map_segment`: copy-on-write to
serve from it, else to copy out of it). Every segment is registered with the creator's resource
tracker, so it is unlinked even when the trainer is killed; `remove_stale_segments` deletes what a
dead creator left. On CUDA the layout is one device buffer behind an IPC handle (`cuda_ipc_handle`,
`open_cuda_ipc`, read by an unpickler that resolves only torch's CUDA tensor reduction). Ping-pong
sets, reuse and teardown: docs/weight-sync.md, "Transports" (shm)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import mmap
import os
import pickle
import re
import uuid
import warnings
from collections.abc import Callable, Collection, Sequence
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch

from tandem.errors import TandemError

SHM_DIR = Path("/dev/shm")
PREFIX = "tandem-w-"
ALIGN = 64
_NAME = re.compile(r"^tandem-w-[A-Za-z0-9_.-]{1,200}$")


class ShmError(TandemError, RuntimeError):
    """A shared-memory segment is missing, malformed or too small."""


def layout(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> tuple[list[int], int]:
    """Offsets of each tensor in a segment (or flat buffer) and its size, each tensor stored in
    `dtype` (default: its own) at an offset aligned to `ALIGN` bytes."""
    offsets, end = [], 0
    for t in tensors:
        element = t.element_size() if dtype is None else _element_size(dtype)
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += t.numel() * element
    return offsets, max(end, 1)


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def pack(buf: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
         dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Copy (casting to `dtype` when given) each tensor into the uint8 buffer `buf` at its offset;
    -> the views (one per tensor, in the stored dtype). No allocation: the cast writes straight
    into `buf`."""
    views = []
    for t, off in zip(tensors, offsets, strict=True):
        view = _view(buf, off, t.shape, dtype or t.dtype)
        view.copy_(t)
        views.append(view)
    return views


def segment_path(name: str) -> Path:
    if not _NAME.match(name):
        raise ShmError(f"{name!r} is not a weight segment name ({PREFIX}...)")
    return SHM_DIR / name


def _view(buf: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * _element_size(dtype)
    if offset < 0 or offset % ALIGN or offset + nbytes > buf.numel():
        raise ShmError(f"tensor at offset {offset} ({nbytes} bytes) does not fit the segment of {buf.numel()} bytes "
                       f"(offsets must be multiples of {ALIGN})")
    return buf[offset:offset + nbytes].view(dtype).view(tuple(shape))


class ShmWriter:
    """Trainer side: the segments of one set, unlinked together by `close`. Buckets are written
    back to back into one segment while they fit (a new one is opened when not), so a whole update
    normally lives in one segment and an announcement may cover several buckets (a window of it).

    `rewind(expected)` starts the next update over the same memory: pages of a kept segment are
    already allocated (fresh tmpfs pages cost far more than the copy itself). `expected` (the
    update's size, when known) sizes the first segment; after a pass that needed several segments
    they are replaced by one of the total size."""

    def __init__(self, tag: str | None = None):
        self.token = f"{os.getpid()}-{tag or uuid.uuid4().hex[:12]}"
        self.paths: list[Path] = []
        self._maps: list[mmap.mmap] = []
        self._seg = 0  # the segment the next `write` goes to
        self._cursor = 0  # and where in it
        self._expected = 0  # bytes the current update is expected to need
        self._done = 0  # bytes taken in the segments before `_seg`

    def rewind(self, expected: int | None = None) -> None:
        want = max(expected or 0, self.used)
        if len(self._maps) > 1 or (self._maps and len(self._maps[0]) < want):
            self.close()  # consolidate: the next write opens one segment of the whole size
        self._seg = self._cursor = self._done = 0
        self._expected = want

    def write(self, tensors: Sequence[torch.Tensor],
              dtype: torch.dtype | None = None) -> tuple[str, list[int], int, list[torch.Tensor]]:
        """`tensors` (cast to `dtype` when given, straight into the segment) after the previous
        bucket; -> (segment name, offsets in it, the segment's size, views of the written tensors)."""
        name, offsets, size, views = self.reserve(tensors, dtype)
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)
        return name, offsets, size, views

    def reserve(self, tensors: Sequence[torch.Tensor],
                dtype: torch.dtype | None = None) -> tuple[str, list[int], int, list[torch.Tensor]]:
        """Room for `tensors` (only their shapes and dtypes count: meta tensors will do) after the
        previous bucket, as `write` places them, left for the caller to fill; same result."""
        rel, nbytes = layout(tensors, dtype)
        start = -(-self._cursor // ALIGN) * ALIGN
        if self._seg < len(self._maps) and start + nbytes > len(self._maps[self._seg]) and start > 0:
            self._done += start  # does not fit after the previous bucket: the next segment
            self._seg, self._cursor, start = self._seg + 1, 0, 0
        if self._seg >= len(self._maps):
            self._open(max(nbytes, self._expected - self._done))
        elif nbytes > len(self._maps[self._seg]):  # a kept segment too small for this bucket alone
            self._replace(self._seg, max(nbytes, self._expected - self._done))
        mm, name = self._maps[self._seg], self.paths[self._seg].name
        offsets = [start + o for o in rel]
        views = tensor_views(torch.frombuffer(mm, dtype=torch.uint8), offsets, [t.shape for t in tensors],
                             [dtype or t.dtype for t in tensors])
        self._cursor = start + nbytes
        return name, offsets, len(mm), views

    @property
    def used(self) -> int:
        """Bytes this update has taken so far (alignment included)."""
        return self._done + self._cursor

    def _create(self, nbytes: int) -> tuple[Path, mmap.mmap]:
        name = f"{PREFIX}{self.token}-{len(self.paths)}-{uuid.uuid4().hex[:6]}"
        path = segment_path(name)
        _track(path)  # before the file exists: there is no moment at which it could be left untracked
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except BaseException:
            _untrack(path)
            raise
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            _remove(path)
            raise
        finally:
            os.close(fd)
        return path, mm

    def _open(self, nbytes: int) -> None:
        path, mm = self._create(nbytes)
        self.paths.append(path)
        self._maps.append(mm)

    def _replace(self, k: int, nbytes: int) -> None:
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self._maps[k].close()
        _remove(self.paths[k])
        self.paths[k], self._maps[k] = self._create(nbytes)

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent). Views returned by `write` must be gone."""
        for mm in self._maps:
            with contextlib.suppress(BufferError, ValueError, AttributeError):
                mm.close()
        self._maps.clear()
        for path in self.paths:
            _remove(path)
        self.paths.clear()
        self._seg = self._cursor = self._done = 0


def _track(path: Path) -> None:
    """Register a segment with this process's multiprocessing resource tracker: a helper process
    that outlives its creator by design and unlinks what is still registered once this process is
    gone, however it went (SIGKILL included)."""
    resource_tracker.register(f"/{path.name}", "shared_memory")


def _untrack(path: Path) -> None:
    resource_tracker.unregister(f"/{path.name}", "shared_memory")


def _remove(path: Path) -> None:
    """Unlink a segment this process created (if it still has its name) and untrack it."""
    path.unlink(missing_ok=True)
    _untrack(path)


MADV_POPULATE_READ = 22  # Linux >= 5.14: fault every page in for reading (no copy-on-write break)


def map_segment(name: str, nbytes: int, private: bool = False, start: int = 0,
                end: int | None = None) -> tuple[torch.Tensor, int]:
    """Server side: a uint8 view of bytes [start, end) of a segment of `nbytes` (default: all of
    it), its pages mapped up front; -> (view, base): byte `base + i` of the segment is view[i]
    (`base` is `start` rounded down to the mapping granularity). The mapping lives as long as the
    view or any view of it (unlinking the file does not end it).

    Default: read-only and shared, to copy out of. `private=True` (to serve from in place):
    copy-on-write, so reads share the writer's pages while a write by this process, should any
    code path ever write a parameter in place, lands in a private copy instead of faulting or
    reaching the trainer's segment."""
    path = segment_path(name)
    end = nbytes if end is None else end
    if not 0 <= start < end <= nbytes:
        raise ShmError(f"bytes [{start}, {end}) are not inside the segment's {nbytes}")
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise ShmError(f"no shared-memory segment {name!r} (is the trainer on this host?)") from exc
    try:
        size = os.fstat(fd).st_size
        if size < nbytes or nbytes <= 0:
            raise ShmError(f"segment {name!r} has {size} bytes, the request says {nbytes}")
        if private:
            # MAP_POPULATE on a private writable mapping would break copy-on-write on every page
            # (a full copy); populating for reading keeps the pages shared.
            mm = mmap.mmap(fd, end - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=base)
            with contextlib.suppress(OSError):  # older kernels: pages fault in on first use instead
                mm.madvise(MADV_POPULATE_READ)
        else:
            mm = mmap.mmap(fd, end - base, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ, offset=base)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # a read-only buffer (the default mapping): we only copy out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8), base


def tensor_views(buf: torch.Tensor, offsets: Sequence[int], shapes: Sequence[Sequence[int]],
                 dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    return [_view(buf, o, s, d) for o, s, d in zip(offsets, shapes, dtypes, strict=True)]


def remove_stale_segments(creators: Collection[int] | None = None) -> list[str]:
    """Delete segments whose creating process is gone (a trainer that was killed mid-update);
    only those created by one of `creators` (pids) when given."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and (creators is None or int(pid) in creators) and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------ CUDA IPC
def cuda_ipc_handle(tensors: Sequence[torch.Tensor],
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, str, list[int], int]:
    """GPU trainer: one device buffer with the layout above (tensors cast to `dtype` when given)
    and its IPC handle (base64 text). Keep the returned buffer alive until every server has
    committed or discarded the update."""
    from torch.multiprocessing.reductions import reduce_tensor

    offsets, nbytes = layout(tensors, dtype)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
    pack(buf, tensors, offsets, dtype)
    handle = base64.b64encode(pickle.dumps(reduce_tensor(buf))).decode()
    return buf, handle, offsets, nbytes


# Everything `reduce_tensor` pickles for a CUDA tensor (torch.multiprocessing.reductions): the
# rebuild function, the tensor and storage types, torch.Size and a dtype. A handle naming anything
# else is refused before any of it is called, so a forged handle cannot run code on the server.
_IPC_GLOBALS = frozenset({
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Tensor"), ("torch", "Size"),
    ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
})


class _IpcUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _IPC_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise ShmError(f"a CUDA IPC handle may only name torch's rebuild_cuda_tensor and the types it takes, "
                       f"not {module}.{name}")


def load_cuda_ipc_handle(handle: str) -> tuple[Callable[..., torch.Tensor], tuple]:
    """(rebuild function, its arguments) of a handle made by `cuda_ipc_handle`, read with an
    unpickler that resolves only what such a handle contains (`_IPC_GLOBALS`); ShmError otherwise."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        data = base64.b64decode(handle, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ShmError(f"cuda_ipc is not base64 text: {exc}") from exc
    try:
        loaded = _IpcUnpickler(io.BytesIO(data)).load()
    except ShmError:
        raise
    except Exception as exc:
        raise ShmError(f"cuda_ipc is not a CUDA IPC handle: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and loaded[0] is rebuild_cuda_tensor
            and isinstance(loaded[1], tuple)):
        raise ShmError("cuda_ipc is not a CUDA IPC handle (expected torch's rebuild_cuda_tensor and its arguments)")
    return loaded


def open_cuda_ipc(handle: str, device: torch.device) -> torch.Tensor:
    """GPU server: the trainer's buffer, copied onto `device` (the IPC mapping is dropped at once).
    The handle names nothing but torch's CUDA rebuild (`load_cuda_ipc_handle`); it still opens
    device memory of another process, so take it from the trainer only (--api-key on shared hosts)."""
    rebuild, args = load_cuda_ipc_handle(handle)
    shared = rebuild(*args)
    out = shared.to(device, copy=True)
    torch.cuda.current_stream(device).synchronize()
    del shared
    return out
