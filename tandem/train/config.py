"""Configuration of the training engine: `TrainEngineConfig` with its `OptimizerConfig` and
`MicroBatchConfig`.

The run config mounts `TrainEngineConfig` as its `actor` section as it is (with the launch-level
fields added), so every field carries `config_field` metadata; `tandem.config.fields.validate`
checks a whole config, and `TrainEngine` runs it on the one it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.config.fields import config_field as _f
from tandem.config.lora import LoRAConfig
from tandem.data.balance import COSTS
from tandem.errors import ConfigError
from tandem.parallel.config import ParallelizeConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
PACKING = ("ffd", "kk")
ROUTER_REPLAY = ("off", "r2", "r3")
ATTENTION_KERNELS = ("auto", "sdpa", "varlen", "flex")  # tandem.models.common.attention.KERNELS  # see tandem.train.routed_experts

# What deterministic mode sets in the environment (unless set already): cuBLAS's fixed workspace,
# NCCL's ring algorithm (one reduction order whatever the message size; read when a communicator is
# created, and NCCL creates them at the first collective), Inductor's deterministic code generation.
# Trainer ranks get them from the launcher too, before their process group exists.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "TORCH_COMPILE_DETERMINISTIC": "1"}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`, one of `DTYPES` (torch is imported here: config loading
    stays torch-free)."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return getattr(torch, name)


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule (`actor.optimizer` in the run config)."""

    lr: float = _f(1e-6, "Peak learning rate.", min=0.0)
    weight_decay: float = _f(0.01, "Decoupled weight decay.", min=0.0)
    beta1: float = _f(0.9, "Adam beta1.", min=0.0, lt=1.0)
    beta2: float = _f(0.999, "Adam beta2.", min=0.0, lt=1.0)
    eps: float = _f(1e-8, "Adam epsilon.", min=0.0)
    gradient_clipping: float = _f(1.0, "Max global grad norm (0 disables clipping).", min=0.0)
    lr_scheduler: str = _f(
        "constant", "Learning-rate schedule after warmup.", choices=("constant", "linear", "cosine")
    )
    warmup_steps_proportion: float = _f(0.0, "Fraction of total steps spent in linear warmup.", min=0.0, max=1.0)
    min_lr_ratio: float = _f(0.0, "Floor of the decayed learning rate, as a fraction of lr.", min=0.0, max=1.0)


@dataclass
class MicroBatchConfig:
    """How a rank splits its batch. The micro-batch count is the largest of: what
    `max_tokens_per_mb` needs, `n_mbs`, and every other DP rank's count; then rounded up to a
    multiple of `n_mbs_divisor` (e.g. the pipeline depth)."""

    max_tokens_per_mb: int | None = _f(
        2048, "Token budget of one micro-batch on a trainer rank (CPU attention costs grow with its square; "
        "None: no budget).", min=1)
    n_mbs: int = _f(1, "At least this many micro-batches per rank.", min=1)
    n_mbs_divisor: int = _f(1, "The micro-batch count is rounded up to a multiple of this.", min=1)
    packing: str = _f("ffd", "Packing of sequences into micro-batches: first-fit decreasing (fewest under the "
                             "token budget) or Karmarkar-Karp (most even loads in the cost of actor.balance, each "
                             "under the token budget).", choices=PACKING)


@dataclass
class TrainEngineConfig:
    """Everything a `TrainEngine` needs besides the process group.

    `dtype` is the compute (FSDP param) dtype; master weights and optimizer state are float32.
    The ranks are laid out as tp x cp x pp model-parallel groups, the rest data parallel
    (`tandem.parallel.ParallelDims.for_world`); `dp_replicate > 1` gives HSDP (replicas of FSDP groups).
    """

    path: str = _f("", "HF model directory (config.json + safetensors) the engine starts from.")
    dtype: str = _f("float32", "Compute dtype of the training engine (master weights stay float32).",
                    choices=DTYPES)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mb: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    parallelize: ParallelizeConfig = field(default_factory=ParallelizeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    balance: str = _f(
        "tokens", "The cost Karmarkar-Karp evens out when a batch is split over the data-parallel ranks, and over "
                  "micro-batches with mb.packing=kk: tokens (L per sequence) or flops (12*h*L + L^2 with h the "
                  "model's hidden_size: attention makes long sequences cost more than their tokens).", choices=COSTS)
    dp_replicate: int = _f(1, "HSDP: replicas of the FSDP group (must divide the data-parallel size).", min=1)
    tp: int = _f(1, "Tensor-parallel size (the run config derives it from actor.backend).", min=1)
    pp: int = _f(1, "Pipeline-parallel size (the run config derives it from actor.backend).", min=1)
    cp: int = _f(1, "Context-parallel size (the run config derives it from actor.backend).", min=1)
    ep: int = _f(1, "Expert-parallel size of MoE layers (the run config derives it from actor.backend).", min=1)
    etp: int = _f(1, "Expert tensor-parallel size, 1 or tp (the run config derives it from actor.backend).",
                  min=1)
    deterministic: bool = _f(
        False, "Deterministic algorithms and seeds (bit-identical reruns). On CUDA an op without a deterministic "
               "kernel warns instead of failing (torch's warn_only), as in Archon; on CPU it fails.")
    attention: str = _f(
        "auto", "Packed-attention kernel: sdpa (padded or document-masked SDPA), varlen (flash attention's varlen "
                "kernel: CUDA, float16/bfloat16), flex (FlexAttention with a document mask: CUDA) or auto (varlen "
                "on CUDA where it serves the dtype, else flex; sdpa off CUDA).", choices=ATTENTION_KERNELS)
    logprob_chunk_size: int = _f(1024, "Tokens per output-head chunk when computing log-probs.", min=1)
    dist_backend: str | None = _f(None, "torch.distributed backend of the trainer ranks (None: gloo on CPU, "
                                        "nccl on CUDA).")
    device: str = _f("cpu", "Device of the ranks: cpu, cuda, ...")
    seed: int = _f(1, "Seed of Python, NumPy and torch RNGs.", min=0)
    total_train_steps: int = _f(1, "Optimizer steps the LR schedule spans.", min=1)
    router_replay: str = _f(
        "off", "MoE routing replay in the trainer's forwards: off (live routing), r2 (the update passes replay "
               "the routes of the proximal-logprob pass) or r3 (every forward replays the routes the rollout "
               "server used, recorded per token; tokens without one route live). MoE models only; r3 needs "
               "servers that return routes (rollout.backend=tandem or sglang).", choices=ROUTER_REPLAY)
    router_replay_live_mismatch: bool = _f(
        False, "With router_replay=r3, also log the logprob mismatch of a live-routed forward "
               "(moe/mismatch_live/mean and max, next to the replayed mismatch/*): costs one extra no-grad forward "
               "of the step's batch. Needs router_replay=r3.")
    moe_aux_loss_coef: float = _f(
        0.0, "Weight of the MoE load-balancing loss added to the policy loss (0: off, as usual in RL). MoE "
             "models only.", min=0.0)

    def check_attention(self, device_type: str, prefix: str = "") -> None:
        """An attention kernel the device cannot train with, refused with the reason."""
        key = f"{prefix}attention"
        if self.attention == "varlen" and (device_type != "cuda" or self.dtype == "float32"):
            raise ConfigError(f"{key}=varlen is flash attention's kernel: CUDA with dtype float16 or bfloat16 only "
                              f"(here {device_type}, {self.dtype}); set {key}=auto")
        if self.attention == "flex" and device_type != "cuda":
            raise ConfigError(f"{key}=flex trains on CUDA only (torch runs FlexAttention's backward on no CPU); set "
                              f"{key}=auto or sdpa")
