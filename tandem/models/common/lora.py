"""Low-rank adapters (LoRA) on a model's linear layers, and their PEFT names and files.

`add_lora(model, config)` gives each targeted `nn.Linear` (named by its HF module, PEFT's
`target_modules`: `q_proj`, `down_proj`, ...) an adapter `y = W x + (alpha / r) * B A dropout(x)`:
`A` (`a`, `[r, in]`, Kaiming-uniform as `nn.Linear` and PEFT) and `B` (`b`, `[out, r]`, zero, so a
fresh adapter changes nothing). The adapters live in a `lora` ModuleDict of the linear's parent,
keyed by the linear's attribute (`layers.0.attention.lora.wq.a.weight`), so the base parameters
keep their names and the parallel plans can lay out `a` and `b` on their own. Base parameters are
frozen (`requires_grad=False`). The parent's forward adds the adapter (`adapted`).

Files are PEFT's: `adapter_model.safetensors` holds `base_model.model.<hf module>.lora_A.weight`
and `...lora_B.weight`; `adapter_config.json` holds `r`, `lora_alpha`, `lora_dropout`,
`target_modules`. Details: docs/lora.md."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.config.lora import DEFAULT_TARGETS, LoRAConfig
from tandem.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_ADAPTER_PARAM = re.compile(r"(?P<parent>.+)\.lora\.(?P<attr>[^.]+)\.(?P<side>[ab])\.weight")
_PEFT_NAME = re.compile(rf"{re.escape(PEFT_PREFIX)}(?P<module>.+)\.lora_(?P<side>[AB])(\.default)?\.weight")


@dataclass(frozen=True)
class AdapterSpec:
    """What a served adapter is over its base: rank and alpha (`scale = alpha / rank`)."""

    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def read(cls, adapter_dir: str | os.PathLike[str]) -> AdapterSpec:
        config = read_adapter_config(adapter_dir)
        return cls(int(config["r"]), float(config["lora_alpha"]))


class LoRA(nn.Module):
    """`b(a(dropout(x))) * scale`: the low-rank update of one linear layer."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.a = nn.Linear(in_features, rank, bias=False)
        self.b = nn.Linear(rank, out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.dropout(x))) * self.scale


def adapted(module: nn.Module, attr: str, x: torch.Tensor) -> torch.Tensor:
    """`module.<attr>(x)` plus its adapter, when `module.lora` has one for `attr`."""
    y = getattr(module, attr)(x)
    adapters = getattr(module, "lora", None)
    if adapters is not None and attr in adapters:
        y = y + adapters[attr](x)
    return y


def _hf_module(adapter, native_weight: str) -> str | None:
    """HF module name (`model.layers.0.self_attn.q_proj`) of a native `...weight`, or None."""
    try:
        hf = adapter.native_to_hf(native_weight)
    except KeyError:
        return None
    return hf[: -len(".weight")] if hf.endswith(".weight") else None


def add_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Attach adapters to every linear layer of `model` whose HF module name ends in one of
    `config.target_modules`; freeze every other parameter. Works on any device (meta too).
    Returns the HF module names adapted. Raises `ConfigError` for a target the model lacks."""
    adapter = model.spec.state_dict_adapter_cls(model.args)
    found: dict[str, list[tuple[nn.Module, str, nn.Linear]]] = {t: [] for t in config.target_modules}
    for name, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            hf = _hf_module(adapter, f"{name}.{attr}.weight" if name else f"{attr}.weight")
            if hf is not None and hf.rsplit(".", 1)[-1] in found:
                found[hf.rsplit(".", 1)[-1]].append((module, attr, child))
    unknown = sorted(t for t, hits in found.items() if not hits and t not in DEFAULT_TARGETS)
    if unknown or not any(found.values()):
        raise ConfigError(f"actor.lora.target_modules: {unknown or sorted(found)} name no linear layer of this "
                          f"{model.args.model_type} model; choose among {', '.join(DEFAULT_TARGETS)}")
    absent = sorted(t for t, hits in found.items() if not hits)
    if absent:  # a mixture-of-experts model's MLPs are experts, which take no adapters
        logger.warning("LoRA: %s match no dense linear layer of this %s model (expert MLPs take no adapters); "
                       "they are not adapted", ", ".join(absent), model.args.model_type)
    for p in model.parameters():
        p.requires_grad_(False)
    model.lora_config = config  # what a copy of the whole model needs to match it (a pipeline's export plan)
    for hits in found.values():
        for parent, attr, linear in hits:
            if getattr(parent, "lora", None) is None:
                parent.lora = nn.ModuleDict()
            with torch.device(linear.weight.device):
                parent.lora[attr] = LoRA(linear.in_features, linear.out_features, config.rank, config.alpha,
                                         config.dropout)
    return sorted(_hf_module(adapter, base) for base in base_of_adapters(model).values())


def is_adapter_param(name: str) -> bool:
    return _ADAPTER_PARAM.fullmatch(name) is not None


def base_of_adapters(model: nn.Module) -> dict[str, str]:
    """Native `<parent>.lora.<attr>.a.weight` -> the native weight it adapts, `<parent>.<attr>.weight`
    (one entry per adapter, keyed by its `a`)."""
    return {n: f"{m['parent']}.{m['attr']}.weight" for n, _ in model.named_parameters()
            if (m := _ADAPTER_PARAM.fullmatch(n)) and m["side"] == "a"}


def peft_name(adapter, native: str) -> str:
    """PEFT's tensor name of native adapter parameter `native` (`adapter`: the family's
    `StateDictAdapter`)."""
    m = _ADAPTER_PARAM.fullmatch(native)
    if m is None:
        raise KeyError(f"{native!r} is not an adapter parameter")
    hf = _hf_module(adapter, f"{m['parent']}.{m['attr']}.weight")
    if hf is None:
        raise KeyError(f"no HF module for adapter parameter {native!r}")
    return f"{PEFT_PREFIX}{hf}.lora_{m['side'].upper()}.weight"


def parse_peft_name(name: str) -> tuple[str, str]:
    """(HF module, "A" or "B") of a PEFT adapter tensor name; CheckpointError for another name."""
    m = _PEFT_NAME.fullmatch(name)
    if m is None:
        raise CheckpointError(f"{name!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A.weight or "
                              "lora_B)")
    return m["module"], m["side"]


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, str, nn.Parameter]]:
    """(native name, PEFT name, parameter) of every adapter parameter, in `named_parameters` order."""
    adapter = model.spec.state_dict_adapter_cls(model.args)
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            yield name, peft_name(adapter, name), p


def fresh_adapter(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """PEFT name -> the whole initial tensor of every adapter parameter: `a` Kaiming-uniform
    (`nn.Linear`'s init, PEFT's default), `b` zero. Each drawn from a generator seeded by `seed`
    and the tensor's name: the same whatever the layout (a pipeline stage draws only its own)."""
    out = {}
    for _, peft, p in adapter_parameters(model):
        if peft.endswith("lora_B.weight"):
            out[peft] = torch.zeros(p.shape)
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(peft.encode()))
        bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) of an [r, in] weight
        out[peft] = torch.empty(p.shape).uniform_(-bound, bound, generator=generator)
    return out


def read_adapter_config(adapter_dir: str | os.PathLike[str]) -> dict:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{str(adapter_dir)!r} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')!r}, only LORA adapters are supported")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise CheckpointError(f"{path}: {key}=true is not supported (plain LoRA only)")
    return config


def check_adapter_fits(adapter_dir: str | os.PathLike[str], config: LoRAConfig, key: str = "actor.lora") -> None:
    """The adapter at `adapter_dir` was made with `config`'s rank, alpha and targets; ConfigError
    naming the differing key otherwise."""
    saved = read_adapter_config(adapter_dir)
    targets = saved["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    got = {"rank": int(saved["r"]), "alpha": float(saved["lora_alpha"]), "target_modules": sorted(targets)}
    want = {"rank": config.rank, "alpha": float(config.alpha), "target_modules": sorted(config.target_modules)}
    for k in want:
        if got[k] != want[k]:
            raise ConfigError(f"{key}.{k}={want[k]!r} but the adapter at {str(adapter_dir)!r} was made with "
                              f"{got[k]!r}; set {key}.{k}={got[k]!r}")


def write_adapter(out_dir: str | os.PathLike[str], tensors: dict[str, torch.Tensor], config: LoRAConfig,
                  base_model: str = "") -> Path:
    """A PEFT adapter directory of `tensors` (PEFT names), written to a temporary name first."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config.peft_config(base_model), indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def read_adapter(adapter_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """PEFT name -> tensor of an adapter directory (`.default` in names dropped)."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{str(adapter_dir)!r} has no {ADAPTER_WEIGHTS}")
    return {k.replace(".default.weight", ".weight"): v for k, v in load_file(str(path)).items()}


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`base + scale * b @ a`, computed in float32 (one fused pass over the weight: it is a server's
    whole update cost, measured in docs/lora.md), returned in `base`'s dtype."""
    return torch.addmm(base.float(), b.float(), a.float(), alpha=scale).to(base.dtype)
