"""`WeightReceiver`: all weight-update state of one server and the work behind its weight routes.

Every update is staged and validated (names, shapes, finite values) before anything is swapped; a
refused one raises ControlError and the previous weights and version keep serving. Bucket 0 (or a
one-shot update) starts a new staged set; bucket k > 0 must follow k - 1; a failed bucket drops
the whole set. Staging buffers are ping-ponged with the live weights where the swap can rebind
(no copy). See docs/weight-sync.md, "Transports", and docs/inference.md, "Weight updates"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.inference.adapter_merge import AdapterMerger, is_adapter_update
from tandem.inference.engine import LLMEngine
from tandem.inference.errors import WeightUpdateError
from tandem.inference.server.engine_loop import EngineLoop
from tandem.inference.server.http_api import ApiError, ControlError
from tandem.inference.server.weights.requests import (
    DiskUpdate,
    DistributedBucket,
    GroupJoin,
    SharedBucket,
    Stage,
)
from tandem.inference.server.weights.staging import Staging, byte_window
from tandem.inference.weight_swap import mark_adoptable, stage_weights, weight_checksums
from tandem.models.common.lora import ADAPTER_CONFIG, AdapterSpec, read_adapter
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights import WeightGroup, WeightGroupError, init_weight_group
from tandem.weights.receive import receive, receive_flat
from tandem.weights.shm import ShmError, map_segment, open_cuda_ipc, tensor_views


@dataclass(frozen=True)
class Applied:
    """What an update call did: `message` for the answer; `weight_version` (the version now
    serving) when it swapped weights in, None when it only staged them."""

    message: str
    weight_version: int | None = None


class WeightReceiver:
    """Transfer groups, the staged set, the staging and live buffers, and the lock that orders
    updates. Methods run on the server's event loop; tensors move on worker threads, and only the
    swap itself runs on the engine thread, between two steps."""

    def __init__(self, engine_loop: EngineLoop, weights_released: Callable[[], bool]):
        self.engine_loop = engine_loop
        self.weights_released = weights_released  # true while /release_memory_occupation holds the weights
        self.lock = asyncio.Lock()  # one weight update / memory change at a time (the memory routes take it too)
        self.groups: dict[str, WeightGroup] = {}  # group name -> joined transfer group
        self.left: dict[str, asyncio.Event] = {}  # group name -> set when it is left (a receive on it lets go)
        self.staged: Staging | None = None  # buckets of an update not committed yet
        self.staging_buffers: dict[int, torch.Tensor] = {}  # bucket index -> uint8 buffer its bucket lands in
        self.live_buffers: dict[int, torch.Tensor] = {}  # buffers the parameters are views of (ping-pong)
        self.adapters = AdapterMerger()  # base copies under a merged LoRA adapter

    @property
    def engine(self) -> LLMEngine:
        engine = self.engine_loop.engine
        if engine is None:
            raise ApiError("the server is starting; poll /health", 503)
        return engine

    # --------------------------------------------------------------------------- disk
    async def load_from_disk(self, update: DiskUpdate) -> Applied:
        """Read the checkpoint at `update.path` (a full set) on a worker thread; swap it in, or
        check it all and stage it."""
        async with self.lock:
            self.check_weights_present()
            alpha = None
            try:
                if (Path(update.path) / ADAPTER_CONFIG).is_file():  # a PEFT adapter directory
                    alpha = AdapterSpec.read(update.path).alpha
                    tensors = await asyncio.to_thread(lambda: list(read_adapter(update.path).items()))
                else:
                    tensors = await asyncio.to_thread(lambda: list(iter_hf_tensors(update.path)))
            except Exception as exc:  # missing directory, no safetensors, corrupt file
                raise ControlError(f"cannot read a checkpoint at {update.path!r}: {exc}; the previous weights "
                                   "keep serving") from exc
            if update.stage.commit:
                await self._load(tensors, update.stage.weight_version, update.stage.abort_all, lora_alpha=alpha)
                return Applied(f"loaded weights from {update.path}", self.engine.weight_version)
            self.discard()
            try:  # a checkpoint is a full set: check it all now, so the commit cannot fail on it
                if alpha is None:
                    await asyncio.to_thread(stage_weights, self.engine.model, tensors, strict_dtype=False)
                else:
                    AdapterMerger.check(self.engine.model, tensors)
            except WeightUpdateError as exc:
                raise ControlError(f"{exc}; the previous weights keep serving") from exc
            staging = Staging(f"disk:{update.path}", lora_alpha=alpha)
            staging.add(tensors)
            self.staged = staging
        return Applied(f"staged weights from {update.path} ({len(tensors)} tensors)")

    # --------------------------------------------------------------------------- groups
    async def join(self, join: GroupJoin) -> str:
        """Join the trainer's group (returns once all members joined); -> the answer's message."""
        if join.name in self.groups:
            raise ControlError(f"weight group {join.name!r} already exists; destroy it first")
        try:
            group = await asyncio.to_thread(init_weight_group, join.address, join.port, join.rank, join.world_size,
                                            group_name=join.name, backend=join.backend, timeout_s=join.timeout_s)
        except WeightGroupError as exc:
            raise ControlError(str(exc)) from exc
        if join.name in self.groups:  # a concurrent join of the same name won
            await asyncio.to_thread(group.destroy)
            raise ControlError(f"weight group {join.name!r} already exists; destroy it first")
        self.groups[join.name] = group
        self.left[join.name] = asyncio.Event()
        return f"joined weight group {join.name!r} as rank {join.rank} of {join.world_size} ({join.backend})"

    async def leave(self, name: str) -> None:
        """Leave group `name`, dropping a set staged from it."""
        group = self.groups.pop(name, None)
        if group is None:
            raise ControlError(f"no weight group {name!r}")
        self.left.pop(name).set()
        if self.staged is not None and self.staged.source == f"group {name!r}":
            self.discard()
        await asyncio.to_thread(group.destroy)

    def close(self) -> None:
        """Leave every group (server shutdown)."""
        groups, self.groups = list(self.groups.values()), {}
        for left in self.left.values():
            left.set()
        self.left = {}
        for group in groups:
            group.destroy()

    async def receive_distributed(self, bucket: DistributedBucket, kill_after: int | None = None) -> Applied:
        """Receive one bucket over its group (a broadcast per tensor, or one flat broadcast) and
        commit or stage it. A well-formed bucket the model refuses is still received (and dropped),
        so the group stays in step with the trainer. `kill_after`: fault injection (`receive`)."""
        name, meta, stage, flat = bucket.group_name, bucket.tensors, bucket.stage, bucket.flat
        group, left = self.groups.get(name), self.left.get(name)
        if group is None or left is None:
            raise ControlError(f"no weight group {name!r}; call /init_weights_update_group first")
        async with self.lock:
            problem = None
            staging: Staging | None = None
            try:
                staging = self._staging_for(f"group {name!r}", stage)
                self._check_bucket(staging, meta.meta_tensors(), stage)
                if flat is not None:  # the layout must fit the buffer (checked on a meta tensor)
                    tensor_views(torch.empty(flat.nbytes, dtype=torch.uint8, device="meta"), flat.offsets,
                                 meta.shapes, meta.dtypes)
            except (ControlError, ShmError) as exc:
                problem = str(exc)
            reuse = None
            try:
                if flat is None:
                    tensors = await self._until_left(name, left, None, asyncio.to_thread(
                        receive, group, meta.shapes, meta.dtypes, kill_after))
                else:
                    # Persistent buffer only for a well-formed staged bucket: bucket k of a set is the
                    # only user of buffer k, and bucket 0 drops the previous set before it lands.
                    reuse = stage.bucket_index if problem is None else None
                    buf = self._buffer(reuse, flat.nbytes, group.device)
                    tensors = await self._until_left(name, left, reuse, asyncio.to_thread(
                        receive_flat, group, buf, flat.offsets, meta.shapes, meta.dtypes, kill_after))
            except WeightGroupError as exc:
                self.discard()
                raise ControlError(f"{exc}; the previous weights keep serving") from exc
            if problem is not None or staging is None:
                self.discard()
                raise ControlError(f"{problem}; the tensors were received and dropped, the previous weights keep "
                                   "serving")
            if len(tensors) != len(meta.names):
                raise ControlError("the flat bucket's layout does not fit its buffer")
            # A one-shot bucket (committed, no bucket_index) is applied as SGLang applies it: its
            # tensors now, whatever subset of the model they are; a staged set must be complete.
            return await self._finish(staging, list(zip(meta.names, tensors, strict=True)), stage,
                                      f"{len(meta.names)} tensors from group {name!r}", flat_index=reuse,
                                      partial=stage.commit and stage.bucket_index is None)

    async def _until_left(self, name: str, left: asyncio.Event, reuse: int | None, receiving):
        """The tensors `receiving` gets, unless group `name` is left first (`left`): the trainer gave
        the group up, as when a member stopped mid-broadcast leaves this server blocked in a receive
        that gloo relays through it and that nothing can cut short. Then WeightGroupError, and the
        lock goes to the next update (over a new group) now; the receive runs on to the group's
        timeout in its thread, so staging buffer `reuse`, which it may still write, is dropped."""
        task = asyncio.ensure_future(receiving)
        waiter = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its end is nobody's business
        if reuse is not None:
            self.staging_buffers.pop(reuse, None)
        raise WeightGroupError(f"weight group {name!r} was left while this bucket was being received")

    # --------------------------------------------------------------------------- shared memory
    async def take_shared(self, bucket: SharedBucket) -> Applied:
        """Take one bucket from shared memory and commit or stage it. A zero-copy bucket (CPU
        server) is served from where it is: its copy-on-write views are staged and the commit makes
        them the parameters. Any other staged segment bucket is copied at once into staging buffer
        k (as a flat distributed bucket is received into it) and unmapped: the copy overlaps the
        trainer writing the next bucket and no mapping outlives the request. CUDA IPC buckets
        arrive as a server-owned copy already (copied at commit)."""
        meta, stage = bucket.tensors, bucket.stage
        async with self.lock:
            try:
                staging = self._staging_for("shared memory", stage)
                self._check_bucket(staging, meta.meta_tensors(), stage)
                in_place = bucket.zero_copy and self.engine.device.type == "cpu"
                reuse = stage.bucket_index if not bucket.cuda_ipc and not in_place else None
                # Only the window of the segment this bucket's tensors occupy is mapped (a segment
                # may hold the whole update, announced in several buckets).
                window = byte_window(bucket.offsets, meta.shapes, meta.dtypes, bucket.nbytes)
                tensors = await asyncio.to_thread(self._read_shared, bucket, window, in_place, reuse)
            except (ControlError, ShmError) as exc:
                self.discard()
                raise ControlError(f"{exc}; the previous weights keep serving") from exc
            return await self._finish(staging, list(zip(meta.names, tensors, strict=True)), stage,
                                      f"{len(meta.names)} tensors from shared memory", flat_index=reuse,
                                      in_place=in_place)

    def _read_shared(self, bucket: SharedBucket, window: tuple[int, int], in_place: bool,
                     reuse: int | None) -> list[torch.Tensor]:
        """Worker thread: the bucket's tensors, as views of the CUDA IPC memory, of the mapped
        window (served in place, or a one-shot update copied at commit), or of staging buffer
        `reuse` after copying the window into it."""
        meta, device = bucket.tensors, self.engine.device
        if bucket.cuda_ipc:
            return tensor_views(open_cuda_ipc(bucket.source, device), bucket.offsets, meta.shapes, meta.dtypes)
        mapped, base = map_segment(bucket.source, bucket.nbytes, private=in_place, start=window[0], end=window[1])
        local = [o - base for o in bucket.offsets]
        if in_place or reuse is None:
            return tensor_views(mapped, local, meta.shapes, meta.dtypes)
        tensor_views(mapped, local, meta.shapes, meta.dtypes)  # the layout fits the window
        staged_buf = self._buffer(reuse, mapped.numel(), device)
        staged_buf.copy_(mapped)
        del mapped  # unmapped here
        return tensor_views(staged_buf, local, meta.shapes, meta.dtypes)

    # --------------------------------------------------------------------------- commit, discard
    async def commit(self, weight_version: int | None, abort_all: bool) -> Applied:
        """Swap in the staged set (it must be complete) under `weight_version`."""
        async with self.lock:
            staging = self.staged
            if staging is None:
                raise ControlError("no staged weight update to commit")
            self.check_weights_present()
            return await self._commit(staging, weight_version, abort_all, f"the staged update from {staging.source}")

    def discard(self) -> bool:
        """Drop the staged set, if any (a bucket of it still arriving is refused); -> whether one was."""
        had = self.staged is not None
        if self.staged is not None:
            self.staged.discarded = True
        self.staged = None
        return had

    def drop_buffers(self) -> None:
        """The weights' memory was released: drop what is staged and the staging buffers (the next
        update makes new ones). Call under `lock`."""
        self.discard()
        self.staging_buffers, self.live_buffers = {}, {}

    def check_weights_present(self) -> None:
        if self.weights_released():
            raise ControlError("weights are released; call /resume_memory_occupation first")

    async def checksums(self, names: list[str] | None) -> dict[str, str]:
        """HF name -> sha256 of the served parameters (all of them when `names` is None), and
        PEFT name -> sha256 of the LoRA adapter merged into them, for its names among `names`."""
        async with self.lock:
            self.check_weights_present()
            adapter = [n for n in names if is_adapter_update([n])] if names is not None else []
            weights = [n for n in names if n not in adapter] if names is not None else None
            try:
                sums = await asyncio.to_thread(weight_checksums, self.engine.model, weights)
            except WeightUpdateError as exc:
                raise ControlError(str(exc)) from exc
            served = self.adapters.checksums(adapter)
            if len(served) != len(adapter):
                raise ControlError(f"no adapter tensor named {sorted(set(adapter) - served.keys())[:3]} is served")
            return sums | served

    # --------------------------------------------------------------------------- internals
    def _staging_for(self, source: str, stage: Stage) -> Staging:
        """The staged set this bucket belongs to (a fresh one for bucket 0 or a one-shot update)."""
        current = self.staged
        index = stage.bucket_index
        if index == 0 or (current is None and index is None):
            self.discard()
            current = Staging(source)
            if not stage.commit or index is not None:
                self.staged = current
            return current
        if current is None:
            raise ControlError(f"bucket {index} arrived but nothing is staged (bucket 0 missing or discarded)")
        if current.source != source:
            raise ControlError(f"a staged update from {current.source} is pending; commit or discard it first")
        if index is not None and index != current.buckets:
            self.discard()
            raise ControlError(f"bucket {index} arrived after {current.buckets} staged bucket(s); "
                               "the staged update was discarded")
        return current

    def _check_bucket(self, staging: Staging, named: list[tuple[str, torch.Tensor]], stage: Stage) -> None:
        """Names/shapes/dtypes of one bucket (meta tensors are fine) against the model and the set;
        an adapter's tensors (PEFT names, `stage.lora_alpha` given) as an adapter's."""
        self.check_weights_present()
        twice = sorted({n for n, _ in named} & staging.names)
        if twice or len({n for n, _ in named}) != len(named):
            raise ControlError(f"weight update sends tensor(s) twice: {twice or 'within one bucket'}")
        adapter = is_adapter_update([n for n, _ in named])
        if adapter != (stage.lora_alpha is not None):
            raise ControlError("a LoRA adapter's tensors (PEFT names) travel with 'lora_alpha', and only they do; "
                               f"got {named[0][0]!r} with lora_alpha={stage.lora_alpha}")
        if staging.buckets and staging.lora_alpha != stage.lora_alpha:
            raise ControlError(f"bucket with lora_alpha={stage.lora_alpha} in a set staged with "
                               f"lora_alpha={staging.lora_alpha}; one update is one adapter or whole weights")
        staging.lora_alpha = stage.lora_alpha
        try:
            if adapter:
                AdapterMerger.check(self.engine.model, named, partial=True)
            else:
                stage_weights(self.engine.model, named, strict_dtype=False, partial=True)
        except WeightUpdateError as exc:
            raise ControlError(str(exc)) from exc

    def _buffer(self, index: int | None, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of `nbytes` for one bucket: staging buffer `index` (grown when too
        small), or fresh memory when `index` is None."""
        if index is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        buf = self.staging_buffers.get(index)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self.staging_buffers[index] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    async def _finish(self, staging: Staging, named: list[tuple[str, torch.Tensor]], stage: Stage, what: str,
                      flat_index: int | None = None, in_place: bool = False, partial: bool = False) -> Applied:
        """Add one bucket to `staging`; commit the set when `stage.commit` (`partial`: it may be
        any subset of the model's tensors, copied into those parameters only)."""
        if staging.discarded:
            raise ControlError("the staged update was discarded while this bucket arrived; the previous weights "
                               "keep serving")
        staging.add(named, flat_index, in_place)
        if not stage.commit:
            return Applied(f"staged {what} (bucket {staging.buckets - 1}, {len(staging.names)} tensors so far)")
        return await self._commit(staging, stage.weight_version, stage.abort_all, what, partial)

    async def _commit(self, staging: Staging, version: int | None, abort_all: bool, what: str,
                      partial: bool = False) -> Applied:
        """Swap `staging` in under `version` (`partial`: a subset, copied in place). The set is
        consumed either way: late buckets of it are refused."""
        if self.staged is staging:
            self.staged = None
        staging.discarded = True
        device = self.engine.device
        tensors = [(n, t if t.device == device else t.to(device)) for n, t in staging.tensors]
        staging.tensors = []
        adapter = staging.lora_alpha is not None
        if staging.adoptable and staging.buckets and not partial and not adapter:
            for _, t in tensors:
                mark_adoptable(t, shared=staging.shared)
        if await self._load(tensors, version, abort_all, partial, staging.lora_alpha):
            # Ping-pong: the parameters now live in this set's staging buffers (or shared-memory
            # segments); the buffers that held them until now are free (every parameter was
            # rebound) and become the next staging set.
            live = {k: self.staging_buffers.pop(k) for k in staging.flat if k in self.staging_buffers}
            self.staging_buffers = {**self.staging_buffers, **self.live_buffers}
            self.live_buffers = live
        return Applied(f"loaded {what} ({len(tensors)} tensors)", self.engine.weight_version)

    async def _load(self, tensors: list[tuple[str, torch.Tensor]], version: int | None, abort_all: bool,
                    partial: bool = False, lora_alpha: float | None = None) -> bool:
        """Validate the full set (`partial`: a subset) with `stage_weights` (names, shapes, finite
        values) on a worker thread, so generation goes on meanwhile and a refused set aborts
        nothing; then abort in-flight requests if asked and swap it in between two engine steps.
        A LoRA adapter (`lora_alpha` given; a full adapter) is merged into the base first
        (`AdapterMerger`). -> whether the parameters adopted the tensors. Refused: ControlError,
        nothing changed."""
        model, merger = self.engine.model, self.adapters

        def stage() -> dict:
            if lora_alpha is not None:
                return stage_weights(model, merger.merged(model, tensors, lora_alpha), partial=True)
            staged = stage_weights(model, tensors, strict_dtype=False, partial=partial)
            merger.replaced([n for n, _ in tensors], full=not partial)
            return staged

        try:
            staged = await asyncio.to_thread(stage)
        except WeightUpdateError as exc:
            raise ControlError(f"{exc}; the previous weights keep serving") from exc

        def swap(engine: LLMEngine) -> bool:
            # One engine command: no step runs between the abort and the swap, so no request
            # admitted meanwhile carries a prefix computed by the old weights onto the new ones.
            if abort_all:
                engine.abort(None, abort_all=True)
            return engine.swap_staged(staged, weight_version=version)

        adopted = await self.engine_loop.call(swap)
        if lora_alpha is not None:
            merger.served(tensors)
        return adopted
