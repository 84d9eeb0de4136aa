"""Value models: a causal LM's decoder with a scalar head, as HF stores it.

A critic (PPO's value model) is the actor's architecture whose output head maps each hidden state
to one number instead of vocabulary logits. On disk it is what transformers calls
`<Family>ForTokenClassification` with one label: the decoder's tensors under `model.`, the head as
`score.weight` `[1, hidden]` and `score.bias` `[1]`. `value_config` turns a causal LM's config
into that of its value model, so a critic can start from the actor's checkpoint (its decoder
weights; the head starts at zero, so every value is 0 before the first update).
"""

from __future__ import annotations

from typing import Any

from tandem.errors import ModelConfigError

CAUSAL_LM = "ForCausalLM"
VALUE_MODEL = "ForTokenClassification"
SEQUENCE_CLASSIFIER = "ForSequenceClassification"  # a reward model: labels scored at the last token
# HF names of the value head's tensors.
SCORE_WEIGHT = "score.weight"
SCORE_BIAS = "score.bias"


def is_value_config(cfg: dict[str, Any]) -> bool:
    """Whether an HF config describes a value model (a token classifier with one label); a token
    classifier with several labels is refused (it is not a value model)."""
    archs = cfg.get("architectures") or []
    if not archs or not str(archs[0]).endswith(VALUE_MODEL):
        return False
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    if int(labels) != 1:
        raise ModelConfigError(f"{archs[0]} with {labels} labels is not a value model: a critic has one output "
                               "per token (num_labels 1)")
    return True


def classifier_labels(cfg: dict[str, Any]) -> int:
    """The labels of a sequence classifier config (`<Family>ForSequenceClassification`: a reward
    model, one label, or a classifier: its head `score.weight` `[labels, hidden]`, no bias, read at
    each sequence's last token, as transformers does); 0 for any other model."""
    archs = cfg.get("architectures") or []
    if not archs or not str(archs[0]).endswith(SEQUENCE_CLASSIFIER):
        return 0
    labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)  # transformers' default: 2
    if labels < 1:
        raise ModelConfigError(f"{archs[0]} with {labels} labels scores nothing: num_labels must be >= 1")
    return labels


def value_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the value model of causal LM config `cfg` (architecture
    `<Family>ForTokenClassification`, one label); a value model's config is returned unchanged."""
    if is_value_config(cfg):
        return dict(cfg)
    archs = cfg.get("architectures") or []
    if archs and not str(archs[0]).endswith(CAUSAL_LM):
        raise ModelConfigError(f"a value model is made from a causal LM ({CAUSAL_LM}); this config is {archs[0]}")
    out = dict(cfg)
    # Without architectures, the suffix alone marks it (saving writes the family's full name).
    out["architectures"] = [str(archs[0]).removesuffix(CAUSAL_LM) + VALUE_MODEL if archs else VALUE_MODEL]
    out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    out.pop("num_labels", None)
    return out


def config_for_head(cfg: dict[str, Any], value: bool, path: str) -> tuple[dict[str, Any], bool]:
    """The config of the model to build from the checkpoint at `path` (config `cfg`): its value
    model's when `value`, else the causal LM's own; and whether the value head is fresh (the
    checkpoint is a causal LM, so the head is not in it). A value checkpoint where a causal LM is
    needed raises `ModelConfigError`."""
    if value:
        return value_config(cfg), not is_value_config(cfg)
    if is_value_config(cfg) or classifier_labels(cfg):
        kind = "a value model" if is_value_config(cfg) else "a sequence classifier (a reward model)"
        raise ModelConfigError(f"{path!r} is {kind} ({cfg['architectures'][0]}), not a causal LM: an actor or "
                               "reference model needs a ...ForCausalLM checkpoint")
    return cfg, False
