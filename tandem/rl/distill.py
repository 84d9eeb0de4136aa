"""A run's teacher (on-policy distillation, `teacher` and `algo.distill`): the pre-launch check
that teacher and student share a tokenizer, and the teacher fleet's start (launched servers or
listed ones) as the `TeacherScorer` the rollout controller awaits on each episode. docs/rewards.md,
"Distillation"."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from tandem.errors import ConfigError
from tandem.fleet.ops import Deadlines
from tandem.launch.affinity import ENV_CPUS
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.rl.cluster import InferenceServers
from tandem.rl.config import TandemConfig
from tandem.rollout.teacher import TeacherScorer

logger = logging.getLogger("tandem.run")


def check_teacher(cfg: TandemConfig) -> None:
    """ConfigError naming both directories unless the teacher's tokenizer maps every token to the
    same id as the actor's: the KL is taken token by token, on the student's token ids."""
    if not cfg.teacher.enabled or cfg.command != "train":
        return
    from transformers import AutoTokenizer  # seconds

    student, teacher = (_vocab(AutoTokenizer, path, key) for path, key in
                        ((cfg.actor.path, "actor.path"), (cfg.teacher.path, "teacher.path")))
    if student == teacher:
        return
    differ = sorted(set(student.items()) ^ set(teacher.items()))
    token = differ[0][0]
    raise ConfigError(
        f"teacher.path={cfg.teacher.path!r} and actor.path={cfg.actor.path!r} have different tokenizers "
        f"({len(student)} and {len(teacher)} tokens; e.g. {token!r} is {student.get(token, 'absent')} in the "
        f"student's and {teacher.get(token, 'absent')} in the teacher's): distillation compares the two models' "
        "logprobs of the same token ids, so the teacher must share the student's tokenizer (e.g. a larger model "
        "of the same family)")


def _vocab(auto_tokenizer: Any, path: str, key: str) -> dict[str, int]:
    try:
        return dict(auto_tokenizer.from_pretrained(path).get_vocab())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path!r}: cannot load its tokenizer: {exc}") from None


def start_teacher(cfg: TandemConfig, scheduler: ProcessScheduler) -> TeacherScorer | None:
    """The teacher fleet (None without a teacher): `teacher.backend`'s servers launched with
    `teacher.path` (each requiring the teacher's API key, `teacher.api_key` or a fresh one), or the
    listed `teacher.servers`; probed with `rollout.health`."""
    t = cfg.teacher
    if not t.enabled or cfg.command != "train":
        return None
    if t.launched_by_tandem:
        api_key = t.api_key or secrets.token_urlsafe(32)
        began = time.monotonic()
        handles = scheduler.start_servers(t.allocation.components[0], t.path, server_args=list(t.server_args),
                                          name="teacher", device=cfg.experiment.device,
                                          env={ENV_CPUS: t.cpus} if t.cpus else None, api_key=api_key,
                                          timeout_s=cfg.scheduler.start_timeout_s)
        servers = InferenceServers([h.url for h in handles], launched=True, api_key=api_key, handles=handles,
                                   server_args=list(t.server_args))
        logger.info("teacher: %d server(s) of %s ready after %.1f s", len(handles), t.path, time.monotonic() - began)
    else:
        servers = InferenceServers(list(t.servers), launched=False, api_key=t.api_key)
    return TeacherScorer(servers.addresses, t, health=cfg.rollout.health, grace_s=cfg.rollout.min_servers_grace_s,
                         deadlines=Deadlines(http_s=cfg.rollout.control_timeout_s), api_key=servers.api_key)
