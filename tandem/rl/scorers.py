"""A run's scoring fleets (`teacher`: on-policy distillation; `reward_model`: a model as the
reward; `judge`: a model's verdict as the reward): the pre-launch checks (a teacher and a reward
model share the actor's tokenizer; a reward model is a classifier with one label, a judge a causal
LM), and their start (launched servers or listed ones) as the
`ScoringFleet`s the rollout controller awaits on each episode. docs/rewards.md."""

from __future__ import annotations

import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from tandem.errors import ConfigError, ModelConfigError
from tandem.fleet.ops import Deadlines
from tandem.launch.affinity import ENV_CPUS
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.models.value_head import classifier_labels, is_value_config
from tandem.rl.config import TandemConfig
from tandem.rollout.judge import JudgeScorer
from tandem.rollout.reward_model import RewardModelScorer
from tandem.rollout.scoring import ScoringFleet, ScoringFleetConfig
from tandem.rollout.teacher import TeacherScorer

logger = logging.getLogger("tandem.run")


def _sections(cfg: TandemConfig) -> list[ScoringFleetConfig]:
    """The scoring fleets this run has (`tandem train` only; the config refuses them elsewhere)."""
    if cfg.command != "train":
        return []
    return [s for s in (cfg.teacher, cfg.reward_model, cfg.judge) if s.enabled]


def check_scorers(cfg: TandemConfig) -> None:
    """ConfigError naming the key, before anything starts: a reward model that is not a classifier
    with one label; a teacher or reward model whose tokenizer maps a token to another id than the
    actor's (both score the policy's token ids), naming both directories."""
    sections = _sections(cfg)
    if not sections:
        return
    if cfg.reward_model.enabled:
        _check_classifier(cfg.reward_model.path)
    if cfg.judge.enabled:
        _check_generator(cfg.judge.path)
    from transformers import AutoTokenizer  # seconds

    student = _vocab(AutoTokenizer, cfg.actor.path, "actor.path")
    for section in sections:
        if section is cfg.judge:  # it reads text: any tokenizer will do, if it loads
            _vocab(AutoTokenizer, section.path, "judge.path")
            continue
        key = f"{section.SECTION}.path"
        other = _vocab(AutoTokenizer, section.path, key)
        if other == student:
            continue
        differ = sorted(set(student.items()) ^ set(other.items()))
        token = differ[0][0]
        raise ConfigError(
            f"{key}={section.path!r} and actor.path={cfg.actor.path!r} have different tokenizers ({len(other)} and "
            f"{len(student)} tokens; e.g. {token!r} is {other.get(token, 'absent')} in the {section.SECTION}'s and "
            f"{student.get(token, 'absent')} in the actor's): it scores the policy's token ids, so it must share the "
            "actor's tokenizer (e.g. a model of the same family)")


def _check_classifier(path: str) -> None:
    hf = json.loads((Path(path) / "config.json").read_text())
    arch = (hf.get("architectures") or ["a model without architectures"])[0]
    try:
        labels = classifier_labels(hf) or (1 if is_value_config(hf) else 0)
    except ModelConfigError as exc:
        raise ConfigError(f"reward_model.path: {exc}") from None
    if labels != 1:
        raise ConfigError(f"reward_model.path={path!r} is {arch}" + (f" with {labels} labels" if labels else "")
                          + ": a reward model is a ...ForSequenceClassification with one label (or the critic's "
                            "...ForTokenClassification layout)")


def _check_generator(path: str) -> None:
    hf = json.loads((Path(path) / "config.json").read_text())
    if classifier_labels(hf) or is_value_config(hf):
        arch = (hf.get("architectures") or ["?"])[0]
        raise ConfigError(f"judge.path={path!r} is {arch}, a classifier: a judge writes its verdict, so it is a causal "
                          "LM (...ForCausalLM); a classifier's score is a reward model (reward_model.path)")


def _vocab(auto_tokenizer: Any, path: str, key: str) -> dict[str, int]:
    try:
        return dict(auto_tokenizer.from_pretrained(path).get_vocab())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path!r}: cannot load its tokenizer: {exc}") from None


def start_scorers(cfg: TandemConfig, scheduler: ProcessScheduler, tokenizer: Any) -> list[ScoringFleet]:
    """Each scoring fleet of the run: its `backend`'s servers launched with its `path` (named
    `teacher-N` / `reward_model-N` / `judge-N`, each requiring its API key, the section's or a fresh
    one), or its listed `servers`; probed with `rollout.health`. `tokenizer`: the actor's (a judge
    decodes the policy's tokens with it)."""
    out: list[ScoringFleet] = []
    for section in _sections(cfg):
        if section.launched_by_tandem:
            api_key = section.api_key or secrets.token_urlsafe(32)
            began = time.monotonic()
            handles = scheduler.start_servers(section.allocation.components[0], section.path,
                                              server_args=[*section.LAUNCH_ARGS, *section.server_args],
                                              name=section.SECTION, device=cfg.experiment.device,
                                              env={ENV_CPUS: section.cpus} if section.cpus else None, api_key=api_key,
                                              timeout_s=cfg.scheduler.start_timeout_s)
            addresses = [h.url for h in handles]
            logger.info("%s: %d server(s) of %s ready after %.1f s", section.SECTION, len(handles), section.path,
                        time.monotonic() - began)
        else:
            api_key, addresses = section.api_key, list(section.servers)
        common = dict(health=cfg.rollout.health, grace_s=cfg.rollout.min_servers_grace_s,
                      deadlines=Deadlines(http_s=cfg.rollout.control_timeout_s), api_key=api_key)
        if section is cfg.teacher:
            out.append(TeacherScorer(addresses, section, **common))
        elif section is cfg.judge:
            from transformers import AutoTokenizer

            out.append(JudgeScorer(addresses, config=cfg.judge, policy_tokenizer=tokenizer,
                                   judge_tokenizer=AutoTokenizer.from_pretrained(cfg.judge.path), **common))
        else:
            out.append(RewardModelScorer(addresses, section, mode=cfg.reward_model.mode, **common))
    return out
