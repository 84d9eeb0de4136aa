"""Locally made models: a tokenizer trained on the built-in tasks' text and size presets."""

from tandem.models.tiny.presets import PRESETS, Preset, hf_config_for, init_model
from tandem.models.tiny.tokenizer import build_tokenizer, save_tokenizer, special_token_ids

__all__ = ["PRESETS", "Preset", "build_tokenizer", "hf_config_for", "init_model", "save_tokenizer", "special_token_ids"]
