"""Options for how a model is parallelised (what `ModelSpec.parallelize` receives besides the
dims, the mesh and the compute dtypes). Mounted in the run config as `actor.parallelize`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.config.fields import config_field as _f
from tandem.errors import ConfigError

AC_MODES = ("auto", "none", "full", "selective", "memory_budget")
AC_SELECTIVE = ("layer", "op")
RESHARD_POLICIES = ("default", "always", "never")
# Pipeline schedules (torch.distributed.pipelining names) and AReaL's short names for them.
SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Split backward into input and weight gradients (torch runs them on no compiled block).
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2*pp-1-r
SHORT_NAMES = {"I1F1B": "Interleaved1F1B", "IZB": "InterleavedZeroBubble", "ZBV": "ZBVZeroBubble"}
PP_SCHEDULE_CHOICES = SCHEDULES + tuple(SHORT_NAMES)


@dataclass
class ParallelizeConfig:
    """Activation checkpointing, per-block compile and FSDP resharding and offload. Checked by
    `tandem.config.fields.validate` (the training engine runs it on its whole config)."""

    activation_checkpoint: str = _f(
        "auto", "Recompute activations in backward: every transformer block (full); some of them "
        "(selective, see ac_selective); or as much as torch.compile's partitioner needs to keep "
        "ac_memory_budget of the activations (memory_budget, needs compile). auto: op-level selective on CUDA "
        "(the Archon default), none elsewhere.", choices=AC_MODES)
    ac_selective: str = _f(
        "layer", "With selective checkpointing: every ac_every-th block (layer), or inside every block keep "
        "matmul and attention outputs and recompute the cheap elementwise ops and norms (op).",
        choices=AC_SELECTIVE)
    ac_every: int = _f(1, "With layer-level selective checkpointing: every N-th block.", min=1)
    ac_memory_budget: float = _f(
        0.5, "With memory_budget: the fraction of activation memory compile's partitioner may keep "
        "(0 recomputes all it can, 1 keeps everything).", min=0.0, max=1.0)
    ac_debug: bool = _f(
        False, "Log, per checkpointed block, what activation checkpointing saves and recomputes: which blocks are "
        "checkpointed, and per block the ops whose outputs its forward kept (op-level) and the ops its backward "
        "ran again, counted (trainer rank logs; slower: every op of a checkpointed block is observed). Needs "
        "activation checkpointing on (full or selective) and eager blocks (compile off).")
    compile: bool | None = _f(
        None, "torch.compile each transformer block (None: on CUDA, the Archon default; off elsewhere, where it "
        "buys ~1.1x for a 10-24 s compile).")
    reshard_after_forward: str = _f(
        "default", "Free gathered block parameters after forward: default (all but the last block, which "
        "backward needs at once; never under pipeline parallelism, where every micro-batch would gather "
        "again), always or never.", choices=RESHARD_POLICIES)
    pp_schedule: str = _f(
        "1F1B", "Pipeline schedule when pp > 1 (short names I1F1B, IZB, ZBV accepted). The zero-bubble ones "
        "(InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) run no compiled blocks and no op-level selective "
        "or memory-budget checkpointing.",
        choices=PP_SCHEDULE_CHOICES)
    pp_microbatches: int | None = _f(
        None, "Pipeline micro-batches per step, at least (raised to the number of stages, with a warning, "
        "when lower; None: the number of stages). Each is one engine micro-batch.", min=1)
    pp_stages_per_rank: int | None = _f(
        None, "Pipeline stages per rank (None: 1 for 1F1B, 2 for the interleaved and V schedules; "
        "ZBVZeroBubble and DualPipeV need exactly 2).", min=1)
    offload_params: bool = _f(
        False, "FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory and move "
        "to the accelerator per block (accelerator runs only).")

    def for_device(self, device_type: str, tp: int = 1, pp: int = 1) -> tuple[ParallelizeConfig, list[str]]:
        """A copy with the options left to the device (`compile` None, `activation_checkpoint`
        auto) chosen, and a line for each choice a layout moved off the device's default. CUDA:
        compile on and op-level selective checkpointing, except that the zero-bubble schedules get
        no compile and full checkpointing (`check_pipeline`), and tensor parallelism with compile
        no checkpointing (`check_layout`); elsewhere both off. Options set explicitly stay as they are."""
        cuda = device_type == "cuda"
        zero_bubble = pp > 1 and normalize_schedule(self.pp_schedule) in ZERO_BUBBLE
        notes: list[str] = []
        compile_ = self.compile
        if compile_ is None:
            compile_ = cuda
            if cuda and self.ac_debug:
                compile_ = False
                notes.append("compile off: ac_debug observes the ops of eager blocks")
            elif cuda and zero_bubble:
                compile_ = False
                notes.append(f"compile off: pp_schedule={self.pp_schedule} runs no compiled blocks")
            elif cuda and tp > 1 and self.activation_checkpoint not in ("auto", "none"):
                compile_ = False
                notes.append(f"compile off: activation_checkpoint={self.activation_checkpoint} with tensor "
                             f"parallelism (tp={tp}) cannot be compiled")
        ac, selective = self.activation_checkpoint, self.ac_selective
        if ac == "auto":
            ac, selective = ("selective", "op") if cuda else ("none", selective)
            if ac != "none" and zero_bubble:
                ac = "full"
                notes.append(f"activation checkpointing full: pp_schedule={self.pp_schedule} runs no op-level "
                             "selective checkpointing")
            if ac != "none" and tp > 1 and compile_:
                ac = "none"
                notes.append(f"activation checkpointing off: compile with tensor parallelism (tp={tp}) cannot "
                             "compile checkpointed blocks")
        return replace(self, compile=compile_, activation_checkpoint=ac, ac_selective=selective), notes

    def check(self, prefix: str = "") -> None:
        """Contradictory options. Run on the copy `for_device` returns, where auto and None are chosen."""
        if self.activation_checkpoint == "memory_budget" and self.compile is False:
            raise ConfigError(f"{prefix}activation_checkpoint=memory_budget works through torch.compile's "
                              f"partitioner: set {prefix}compile=true (or choose full / selective)")
        if self.ac_debug and self.activation_checkpoint not in ("full", "selective"):
            raise ConfigError(f"{prefix}ac_debug=true logs what activation checkpointing saves and recomputes, but "
                              f"this run checkpoints no block ({prefix}activation_checkpoint resolves to "
                              f"{self.activation_checkpoint!r}; auto is none off CUDA): set "
                              f"{prefix}activation_checkpoint=full or selective, or {prefix}ac_debug=false")
        if self.ac_debug and self.compile:
            raise ConfigError(f"{prefix}ac_debug=true observes each op of a checkpointed block as it runs, which "
                              f"compiled blocks do not do one by one: set {prefix}compile=false (or leave it unset: "
                              f"ac_debug then turns compile off), or {prefix}ac_debug=false")

    def check_layout(self, tp: int, prefix: str = "") -> None:
        """Options that a parallel layout cannot run, refused with the reason. Under tensor
        parallelism, compile together with activation checkpointing fails inside torch (measured,
        torch 2.13: AOTAutograd cannot save the DeviceMesh a checkpointed DTensor block holds);
        each works with TP on its own."""
        if tp > 1 and self.compile and self.activation_checkpoint == "memory_budget":
            raise ConfigError(
                f"{prefix}activation_checkpoint=memory_budget is not supported with tensor parallelism (tp={tp}): "
                "torch's min-cut partitioner cannot size the process group a tensor-parallel block holds (measured, "
                "torch 2.13: 'Cannot compute the size of FakeScriptObject'); choose full or selective checkpointing "
                f"with {prefix}compile=false, or compile without checkpointing")
        if tp > 1 and self.compile and self.activation_checkpoint not in ("none", "auto"):
            raise ConfigError(
                f"{prefix}compile=true with {prefix}activation_checkpoint={self.activation_checkpoint!r} is not "
                f"supported with tensor parallelism (tp={tp}): torch fails compiling checkpointed "
                f"tensor-parallel blocks; set {prefix}activation_checkpoint=none or {prefix}compile=false")

    def check_device(self, device_type: str, prefix: str = "") -> None:
        """Options that need an accelerator, refused on a CPU-only run with the reason."""
        if self.offload_params and device_type == "cpu":
            raise ConfigError(
                f"{prefix}offload_params=true needs an accelerator: FSDP2 offload keeps parameters in host "
                "memory and copies them to the device per block, and on a CPU run they are in host memory "
                f"already; set {prefix}offload_params=false")

    def check_pipeline(self, prefix: str = "") -> None:
        """The pipeline options, when the layout has pp > 1 (see `check_pipeline_options`). The
        zero-bubble schedules split backward into input and weight gradients: torch runs that
        split on no compiled block, and its input-gradient pass keeps the graph (retain_graph)
        for the weight pass, and op-level selective checkpointing allows one backward per region."""
        name, _ = check_pipeline_options(self.pp_schedule, self.pp_stages_per_rank, prefix)
        if name not in ZERO_BUBBLE:
            return
        if self.compile:
            raise ConfigError(f"{prefix}pp_schedule={self.pp_schedule!r} splits backward into input and weight "
                              f"gradients, which does not work with compiled blocks: set {prefix}compile=false or "
                              f"{prefix}pp_schedule to 1F1B or Interleaved1F1B")
        if self.activation_checkpoint == "memory_budget":
            raise ConfigError(f"{prefix}activation_checkpoint=memory_budget works through torch.compile, which "
                              f"{prefix}pp_schedule={self.pp_schedule!r} cannot run (it splits backward into input "
                              f"and weight gradients): choose full or selective checkpointing, or {prefix}pp_schedule "
                              f"1F1B or Interleaved1F1B")
        if self.activation_checkpoint == "selective" and self.ac_selective == "op":
            raise ConfigError(f"{prefix}pp_schedule={self.pp_schedule!r} splits backward into input and weight "
                              f"gradients, two backward passes over each block, and op-level selective checkpointing "
                              f"allows one (torch: 'Trying to backward an extra time'): set "
                              f"{prefix}ac_selective=layer or {prefix}activation_checkpoint=full, or {prefix}pp_schedule "
                              f"to 1F1B or Interleaved1F1B")


def normalize_schedule(name: str, prefix: str = "actor.parallelize.") -> str:
    """The full schedule name for `name` (a full name or AReaL's short one, any case)."""
    by_lower = {n.lower(): n for n in SCHEDULES} | {k.lower(): v for k, v in SHORT_NAMES.items()}
    if name.lower() not in by_lower:
        raise ConfigError(f"{prefix}pp_schedule={name!r} is unknown; choose one of {', '.join(PP_SCHEDULE_CHOICES)}")
    return by_lower[name.lower()]


def check_pipeline_options(schedule: str, stages_per_rank: int | None,
                           prefix: str = "actor.parallelize.") -> tuple[str, int]:
    """(full schedule name, stages per rank): 1 for 1F1B, at least 2 for the interleaved
    schedules, exactly 2 for the V schedules (default 2 for those). Raises `ConfigError` naming the key."""
    name = normalize_schedule(schedule, prefix)
    key = f"{prefix}pp_stages_per_rank"
    if stages_per_rank is None:
        return name, 1 if name == "1F1B" else 2
    if name == "1F1B" and stages_per_rank != 1:
        raise ConfigError(f"{key}={stages_per_rank}: 1F1B runs one stage per rank; set it to 1 (or leave it "
                          f"unset), or set {prefix}pp_schedule to Interleaved1F1B or InterleavedZeroBubble")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and stages_per_rank < 2:
        raise ConfigError(f"{key}={stages_per_rank}: {name} needs at least 2 stages per rank; raise it, or set "
                          f"{prefix}pp_schedule to 1F1B")
    if name in V_SCHEDULES and stages_per_rank != 2:
        raise ConfigError(f"{key}={stages_per_rank}: {name} runs exactly 2 stages per rank (a V); set it "
                          "to 2 or leave it unset")
    return name, stages_per_rank
