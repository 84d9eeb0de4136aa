"""Allocation mode: how the GPUs are split between inference servers and trainers.

`parse_allocation(spec)` parses the AReaL-compatible language, e.g. `sglang:d4t2+archon:d4p2t2`
(`+`: separate devices, assigned in order; `|`: colocated, binding tighter), into an
`AllocationMode`, or raises `AllocationError` with the offending position. Megatron parses but is
not launchable. Grammar, sizes and scheduling: docs/configuration.md, "Allocation mode"."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.alloc_rules import check_colocation, check_names, resolve_sizes
from tandem.config.alloc_syntax import INFERENCE_BACKENDS, parse_syntax
from tandem.config.parallel_sizes import ParallelSizes, ep_layout_problem
from tandem.errors import AllocationError, ConfigError

__all__ = ["AllocationMode", "Component", "ParallelSizes", "parse_allocation", "parse_allocation_of_kind"]

MEGATRON_NOTE = (
    "megatron is parsed for compatibility but Tandem cannot launch it; use archon with the same dims"
)
# Parallel dims the trainer parses but does not apply yet (each leaves this list when it is built).
TRAINER_DIMS_PENDING: tuple[str, ...] = ()
_SIZE_KEYS = ("dp", "tp", "pp", "cp", "ep", "etp", "edp", "world_size")  # JSON keys read from `sizes`


@dataclass(frozen=True)
class Component:
    """One inference server group or trainer, with its parallel sizes and devices."""

    backend: str
    name: str | None
    sizes: ParallelSizes
    scheduling: str  # "separation" | "colocation"
    target: str | None  # label of the component whose devices a colocated one shares
    devices: range
    hybrid: bool = False  # written in the attn/ffn form

    @property
    def is_inference(self) -> bool:
        return self.backend in INFERENCE_BACKENDS

    @property
    def launch_error(self) -> str | None:
        return MEGATRON_NOTE if self.backend == "megatron" else None

    @property
    def launchable(self) -> bool:
        return self.launch_error is None

    @property
    def run_error(self) -> str | None:
        """Why this version of Tandem cannot run the component as written, or None. Stricter than
        `launch_error` (the grammar's rule): parallelism `tandem serve` and the trainer lack so far."""
        if self.launch_error:
            return self.launch_error
        s = self.sizes
        if self.backend == "tandem" and s.tp * s.pp * s.cp > 1:
            dims = "".join(f"{k}{v}" for k, v in (("t", s.tp), ("p", s.pp), ("c", s.cp)) if v > 1)
            return (f"`tandem serve` runs one device per server; tandem:d{s.dp}{dims} asks for "
                    f"{s.world_size // s.dp} devices per server (use tandem:d{s.world_size})")
        if not self.is_inference and s.etp not in (1, s.tp):
            return (f"expert tensor parallel size etp={s.etp} must be 1 or the attention's tp={s.tp} (experts are "
                    f"whole on each rank, or tensor-parallel over the attention's TP group); write "
                    f"{self.backend}:(attn:...|ffn:e{s.ep}t{s.tp}) or ffn:e{s.ep}")
        problem = None if self.is_inference else ep_layout_problem(s.dp, s.cp, s.tp, s.ep, s.etp)
        if problem:
            return f"expert parallel size: {problem}; change 'e' (e.g. e{s.cp * s.tp}) or 'd'"
        pending = [f"{name}={getattr(s, name)}" for name in TRAINER_DIMS_PENDING if getattr(s, name) > 1]
        if not self.is_inference and pending:
            return (f"the trainer does not apply {', '.join(pending)} yet (it applies "
                    f"{', '.join(n for n in ('dp', 'tp', 'pp', 'cp') if n not in TRAINER_DIMS_PENDING)}); "
                    f"use {self.backend}:d{s.world_size}")
        return None

    @property
    def devices_per_server(self) -> int:
        """An inference component's devices per server (one server per data-parallel replica)."""
        return self.sizes.world_size // self.sizes.dp

    @property
    def label(self) -> str:
        """The name, or the backend for an unnamed component (what `target` refers to)."""
        return self.name or self.backend

    def to_json(self) -> dict[str, object]:
        """backend, name, the sizes (dp ... edp, world_size), scheduling, target: in this order;
        for a training layout whose experts are laid out (ep or etp > 1) also `meshes`."""
        sizes = {key: getattr(self.sizes, key) for key in _SIZE_KEYS}
        out: dict[str, object] = {"backend": self.backend, "name": self.name, **sizes, "scheduling": self.scheduling,
                                  "target": self.target}
        if self.has_expert_mesh:
            out["meshes"] = self.meshes()
        return out

    @property
    def has_expert_mesh(self) -> bool:
        return not self.is_inference and (self.sizes.ep > 1 or self.sizes.etp > 1)

    def meshes(self) -> dict[str, object]:
        """The two views of the same ranks (MoE parallel folding): the attention's `pp, dp, cp,
        tp` and the experts' `pp, edp, ep, etp`, with every rank's place on each (its `ep`
        index: which 1/ep of each MoE layer's experts it holds)."""
        s = self.sizes
        return {
            "attention": {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp},
            "experts": {"pp": s.pp, "edp": s.edp, "ep": s.ep, "etp": s.etp},
            "experts_fold_tp": s.ep_folds_tp,
            "ranks": [{"rank": r, "attention": s.coords(r), "experts": s.expert_coords(r)}
                      for r in range(s.world_size)],
        }

    def explain(self) -> str:
        kind = "inference" if self.is_inference else "training"
        head = f"{self.backend}[{self.name}]" if self.name else self.backend
        first, last = self.devices[0], self.devices[-1]
        where = f"device {first}" if first == last else f"devices {first}-{last}"
        sched = f"colocation with {self.target}" if self.scheduling == "colocation" else "separation"
        s = self.sizes
        text = (
            f"{head} ({kind}): dp={s.dp} tp={s.tp} pp={s.pp} cp={s.cp} ep={s.ep} "
            f"etp={s.etp}, expert dp={s.edp}, world size {s.world_size}, {where}, {sched}"
        )
        if self.has_expert_mesh:
            over = "tp x cp x dp" if s.ep_folds_tp else "cp x dp"
            text += (f"\n  experts: ep={s.ep} over {over} (innermost first), etp={s.etp}, edp={s.edp}; expert shard "
                     f"(ep index) by rank: "
                     + " ".join(f"{r}:{s.expert_coords(r)['ep']}" for r in range(s.world_size)))
        if self.launch_error:
            text += f"\n  note: {self.launch_error}"
        return text


@dataclass(frozen=True)
class AllocationMode:
    """A parsed allocation-mode string; `components` are in the order written."""

    spec: str
    components: tuple[Component, ...]

    @property
    def inference(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.is_inference)

    @property
    def train(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if not c.is_inference)

    @property
    def total_devices(self) -> int:
        return max(c.devices.stop for c in self.components)

    @property
    def launchable(self) -> bool:
        return all(c.launchable for c in self.components)

    def __getitem__(self, name: str) -> Component:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"no component named {name!r} in {self.spec!r}")

    def to_json(self) -> dict[str, list[dict[str, object]]]:
        return {"components": [c.to_json() for c in self.components]}

    def explain(self) -> str:
        lines = [c.explain() for c in self.components]
        lines.append(f"total devices: {self.total_devices}")
        return "\n".join(lines)


def parse_allocation(spec: str) -> AllocationMode:
    """Parse an allocation-mode string; raises `AllocationError` pointing at the problem."""
    if not isinstance(spec, str):
        raise AllocationError(f"allocation mode must be a string, got {type(spec).__name__}")
    groups = parse_syntax(spec)
    sizes = [[resolve_sizes(raw, spec) for raw in group] for group in groups]
    check_names(groups, spec)
    for group, group_sizes in zip(groups, sizes, strict=True):
        check_colocation(group, group_sizes, spec)

    components: list[Component] = []
    next_device = 0
    for group, group_sizes in zip(groups, sizes, strict=True):
        # The whole group lives on the first member's devices, right after the previous group.
        devices = range(next_device, next_device + group_sizes[0].world_size)
        next_device = devices.stop
        anchor = group[0].name or group[0].backend
        for index, (raw, member_sizes) in enumerate(zip(group, group_sizes, strict=True)):
            components.append(
                Component(
                    backend=raw.backend,
                    name=raw.name,
                    sizes=member_sizes,
                    scheduling="colocation" if index else "separation",
                    target=anchor if index else None,
                    devices=devices,
                    hybrid=raw.attn is not None,
                )
            )
    return AllocationMode(spec=spec, components=tuple(components))


def parse_allocation_of_kind(spec: str, key: str, inference: bool) -> AllocationMode:
    """Parse the allocation in config field `key`, whose components must all be inference
    (`inference=True`) or all training backends; a `ConfigError` names the field otherwise."""
    try:
        mode = parse_allocation(spec)
    except AllocationError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if inference:
        wanted, wrong, example = "an inference allocation (sglang, vllm or tandem)", "a training", "tandem:d2"
    else:
        wanted, wrong, example = "a training allocation (archon or fsdp)", "an inference", "archon:d2"
    for comp in mode.components:
        if comp.is_inference != inference:
            raise ConfigError(f"{key}: {comp.backend!r} is {wrong} backend but {key} takes {wanted}, e.g. {example!r}")
    return mode
