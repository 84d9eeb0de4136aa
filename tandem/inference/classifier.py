"""`ClassifierEngine`: a sequence classifier served by `tandem serve --is-embedding` (a reward model).

A reward model is a causal LM's decoder with a score head read at each sequence's last token, as
transformers' `<Family>ForSequenceClassification` computes it (`classifier_labels`: `score.weight`
`[labels, hidden]`, no bias); a value model (`<Family>ForTokenClassification`, one label, the
critic's layout) is served the same way, its last token's value being the score. `classify` runs
one cache-free packed forward over a batch of sequences on the engine thread (no KV cache, no
scheduler: every request is one prefill). The routes are in `tandem.inference.server.classify_routes`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tandem.errors import ModelConfigError
from tandem.inference.engine import load_tokenizer
from tandem.inference.errors import RequestError
from tandem.inference.outputs import Detokenizer
from tandem.models import load_model, read_hf_config
from tandem.models.value_head import classifier_labels, is_value_config


class ClassifierEngine:
    def __init__(self, model_path: str | os.PathLike[str], *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_num_batched_tokens: int = 8192):
        cfg = read_hf_config(model_path)
        self.num_labels = classifier_labels(cfg) or (1 if is_value_config(cfg) else 0)
        if not self.num_labels:
            arch = (cfg.get("architectures") or ["a causal LM"])[0]
            raise ModelConfigError(f"{model_path} is {arch}, not a classifier: --is-embedding serves a "
                                   "...ForSequenceClassification (a reward model) or a ...ForTokenClassification with "
                                   "one label (a value model); serve a causal LM without --is-embedding")
        self.model_path = str(model_path)
        self.device, self.dtype = torch.device(device), dtype
        self.model = load_model(model_path, dtype=dtype, device=device).eval()
        labels = cfg.get("id2label") or {}
        self.labels = [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(self.num_labels)]
        self.max_model_len = int(self.model.args.max_seq_len)
        self.vocab_size = int(self.model.args.vocab_size)
        self.max_total_num_tokens = max_num_batched_tokens  # the most tokens one forward takes
        self.detokenizer = Detokenizer(load_tokenizer(model_path))
        self.weight_version = 0
        self.num_sequences = 0

    def has_unfinished(self) -> bool:
        return False  # the engine loop never steps it: every request is a command

    def check(self, sequences: list[list[int]]) -> None:
        """RequestError naming the sequence for an empty one, a token outside the vocabulary, one
        longer than the model's context or a batch over the token budget of one forward."""
        for i, ids in enumerate(sequences):
            if not ids:
                raise RequestError(f"sequence {i} is empty: a classifier scores at least one token")
            if len(ids) > self.max_model_len:
                raise RequestError(f"sequence {i} has {len(ids)} tokens, more than the model's context of "
                                   f"{self.max_model_len}")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"sequence {i} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        total = sum(len(ids) for ids in sequences)
        if total > self.max_total_num_tokens:
            raise RequestError(f"the request's {len(sequences)} sequences hold {total} tokens, more than one forward "
                               f"takes (--max-num-batched-tokens {self.max_total_num_tokens}); send fewer at a time")

    @torch.inference_mode()
    def classify(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's label scores (raw: logits, or a value model's value) at its last token,
        float32, from one packed forward with the current weights."""
        self.check(sequences)
        ids = torch.tensor([t for seq in sequences for t in seq], device=self.device)
        lengths = torch.tensor([len(seq) for seq in sequences], device=self.device)
        cu = torch.zeros(len(sequences) + 1, dtype=torch.int32, device=self.device)
        cu[1:] = torch.cumsum(lengths, 0)
        hidden = self.model.hidden_states(ids, cu)
        scores = self.model.logits_from_hidden(hidden[cu[1:].long() - 1]).float()
        self.num_sequences += len(sequences)
        return scores.tolist()

    def stats(self) -> dict[str, Any]:
        return {"classified_sequences": self.num_sequences, "num_labels": self.num_labels,
                "weight_version": self.weight_version}
