"""The receiving side of Tandem's weight update inside a vLLM worker: a worker extension that vLLM
mixes into its worker class when started with

    --worker-extension-cls tandem.weights.vllm_worker.TandemWorkerExtension

Called through `/collective_rpc` by `VLLMAdapter(extension=True)`: `tandem_join_group`,
`tandem_stage_bucket` / `tandem_stage_disk`, `tandem_commit` (vLLM's in-place `reload_weights` of
the full staged set), `tandem_discard`, `tandem_leave_group`. Every method answers `{"success":
bool, "message": str}` instead of raising; nothing touches the served weights before the commit,
and the version is set afterwards with `/update_weight_version`. Every worker of the server (one
per device, `--tensor-parallel-size`) runs them: each joins the group as `rank_offset` + its rank
in the server, receives every tensor whole, and at the commit vLLM's own loader
(`model.load_weights`) keeps the worker's shard. See docs/engines.md, "Weight updates"."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.errors import CheckpointError
from tandem.models.hf_checkpoint import read_tensor_shapes
from tandem.weights.group import WeightGroup, WeightGroupError, dtype_from_name, init_weight_group
from tandem.weights.receive import receive, receive_flat

if TYPE_CHECKING:
    from collections.abc import Iterator

HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


class ReceiveError(ValueError):
    """A request the receiver refuses (named field, what to do)."""


@dataclass
class _Receiver:
    """The extension's state in one worker: the group, and what is staged for the next commit."""

    group: WeightGroup | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    disk: str | None = None
    buckets: int = 0
    expected: dict[str, tuple[int, ...]] | None = None  # HF name -> shape, read from the served checkpoint

    def clear(self) -> None:
        self.tensors, self.disk, self.buckets = {}, None, 0


def _answer(ok: bool, message: str) -> dict[str, Any]:
    return {"success": ok, "message": message}


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an HF checkpoint directory (file headers only)."""
    try:
        shapes = {name: shape for name, (shape, _) in read_tensor_shapes(path).items()}
    except CheckpointError as exc:
        raise ReceiveError(str(exc)) from exc
    if not shapes:
        raise ReceiveError(f"{str(path)!r} holds no *.safetensors tensors")
    return shapes


class TandemWorkerExtension:
    """Mixed into vLLM's worker (`self` is the worker: `vllm_config`, `reload_weights`)."""

    # Every name here starts with `tandem_` or `_tandem_`: vLLM refuses an extension whose names
    # collide with its worker's.
    vllm_config: Any  # the worker's
    rank: int  # the worker's rank in the server, 0 .. parallel_config.world_size - 1

    # -- state --------------------------------------------------------------------------------------
    def _tandem_state(self) -> _Receiver:
        receiver = getattr(self, "_tandem_receiver", None)
        if receiver is None:
            receiver = _Receiver()
            self._tandem_receiver = receiver
        return receiver

    def _tandem_tied(self) -> bool:
        return bool(getattr(self.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False))

    def _tandem_expected(self) -> dict[str, tuple[int, ...]]:
        """The tensors a full update carries: those of the checkpoint the server started from
        (a tied head is not expected; it is the embedding)."""
        receiver = self._tandem_state()
        if receiver.expected is None:
            shapes = checkpoint_shapes(self.vllm_config.model_config.model)
            if self._tandem_tied():
                shapes.pop(HEAD, None)
            receiver.expected = shapes
        return receiver.expected

    # -- group ---------------------------------------------------------------------------------------
    def tandem_join_group(self, master_address: str, master_port: int | str, rank_offset: int | str,
                          world_size: int | str, group_name: str, backend: str = "gloo",
                          timeout_s: float | str = 60.0, devices: int | str | None = None) -> dict[str, Any]:
        """Join the trainer's group as rank `rank_offset` + this worker's rank in the server;
        `devices`: the workers the trainer counted for this server (refused when the server has
        another number: the group would never form)."""
        parallel = self.vllm_config.parallel_config
        workers = parallel.world_size
        if getattr(parallel, "data_parallel_size", 1) > 1:
            return _answer(False, f"join_group: this server runs data parallel size {parallel.data_parallel_size}; "
                                  "Tandem's weight group takes one engine per server: start one server per replica")
        if devices is not None and int(devices) != workers:
            return _answer(False, f"join_group: the trainer counts {devices} device(s) for this server but it runs "
                                  f"{workers} worker(s) (tensor x pipeline parallel); make rollout.backend's devices "
                                  f"per server match (e.g. vllm:d1t{workers})")
        if not 0 <= self.rank < workers:
            return _answer(False, f"join_group: worker rank {self.rank} is outside the server's {workers} workers")
        rank = int(rank_offset) + self.rank
        receiver = self._tandem_state()
        if receiver.group is not None:
            receiver.group.destroy()
            receiver.group = None
        receiver.clear()
        try:
            receiver.group = init_weight_group(str(master_address), int(master_port), rank,
                                               int(world_size), group_name, backend, timeout_s=float(timeout_s))
        except (WeightGroupError, ValueError) as exc:
            return _answer(False, f"join_group: {exc}")
        return _answer(True, f"joined {group_name!r} as rank {rank} of {world_size}")

    def tandem_leave_group(self, group_name: str) -> dict[str, Any]:
        receiver = self._tandem_state()
        if receiver.group is None or receiver.group.name != group_name:
            return _answer(False, f"no weight group {group_name!r} to leave")
        receiver.group.destroy()
        receiver.group = None
        receiver.clear()
        return _answer(True, f"left {group_name!r}")

    # -- staging ------------------------------------------------------------------------------------
    def tandem_stage_bucket(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                            offsets: list[int] | None = None, nbytes: int | None = None) -> dict[str, Any]:
        """Receive one bucket (one broadcast per tensor, or with `offsets` + `nbytes` one flat
        uint8 broadcast) and stage it. A flat bucket whose metadata is wrong is still received
        (and dropped), so the group stays in step with the trainer."""
        receiver = self._tandem_state()
        if receiver.group is None or receiver.group.name != group_name:
            return _answer(False, f"no weight group {group_name!r}: send tandem_join_group first")
        try:
            if not (len(names) == len(dtypes) == len(shapes)) or not names:
                raise ReceiveError(f"names, dtypes and shapes must be non-empty lists of one length; got "
                                   f"{len(names)}, {len(dtypes)}, {len(shapes)}")
            torch_dtypes = [dtype_from_name(d) for d in dtypes]
            if offsets is not None:
                if nbytes is None or len(offsets) != len(names):
                    raise ReceiveError("a flat bucket needs nbytes and one offset per tensor")
                buf = torch.empty(int(nbytes), dtype=torch.uint8, device=receiver.group.device)
                tensors = receive_flat(receiver.group, buf, offsets, shapes, torch_dtypes)
                if not tensors:
                    raise ReceiveError(f"the flat bucket's offsets do not fit in nbytes={nbytes}")
            else:
                tensors = receive(receiver.group, shapes, torch_dtypes)
            expected = self._tandem_expected()
            for name, t in zip(names, tensors, strict=True):
                if name not in expected:
                    raise ReceiveError(f"{name!r} is not a tensor of the served model's checkpoint")
                if tuple(t.shape) != expected[name]:
                    raise ReceiveError(f"{name!r}: shape {list(t.shape)}, the served model has {list(expected[name])}")
        except (ReceiveError, WeightGroupError) as exc:
            receiver.clear()  # a bad bucket spoils the update: the trainer discards it
            return _answer(False, f"stage_distributed: {exc}")
        receiver.tensors.update(zip(names, tensors, strict=True))
        receiver.buckets += 1
        return _answer(True, f"staged bucket {receiver.buckets} ({len(names)} tensors)")

    def tandem_stage_disk(self, path: str) -> dict[str, Any]:
        """Stage the HF checkpoint directory at `path` (loaded at commit)."""
        receiver = self._tandem_state()
        receiver.clear()
        try:
            shapes = checkpoint_shapes(path)
            missing = sorted(set(self._tandem_expected()) - set(shapes))
            if missing:
                raise ReceiveError(f"{path!r} lacks {len(missing)} tensors of the served model, e.g. {missing[:3]}")
        except (ReceiveError, OSError, ValueError) as exc:
            return _answer(False, f"load_disk: {exc}")
        receiver.disk = path
        return _answer(True, f"staged {path}")

    def tandem_discard(self) -> dict[str, Any]:
        self._tandem_state().clear()
        return _answer(True, "discarded")

    def tandem_commit(self) -> dict[str, Any]:
        """Load the staged update into the served model; refused (nothing loaded) unless it is a
        full set."""
        receiver = self._tandem_state()
        try:
            if receiver.disk is not None:
                self.reload_weights(weights_path=receiver.disk, is_checkpoint_format=True)
                return _answer(True, f"loaded {receiver.disk}")
            missing = sorted(set(self._tandem_expected()) - set(receiver.tensors))
            if missing:
                raise ReceiveError(f"the staged update lacks {len(missing)} of the model's tensors, e.g. "
                                   f"{missing[:3]}; a commit needs the full set")
            count = len(receiver.tensors)
            self.reload_weights(weights_iterator=self._tandem_with_head(receiver.tensors), is_checkpoint_format=True)
            return _answer(True, f"loaded {count} tensors from {receiver.buckets} buckets")
        except (ReceiveError, OSError, RuntimeError, KeyError, ValueError) as exc:
            return _answer(False, f"commit: {type(exc).__name__}: {exc}")
        finally:
            receiver.clear()

    def _tandem_with_head(self, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from tensors.items()
        # vLLM's CPU build keeps a packed copy of the head that an embedding-only reload leaves stale.
        if self._tandem_tied() and HEAD not in tensors and EMBEDDING in tensors:
            yield HEAD, tensors[EMBEDDING]
