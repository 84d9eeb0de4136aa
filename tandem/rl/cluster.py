"""Bringing up a run's processes: inference servers, trainer workers, the rollout controller.

Shared by `tandem train` and `tandem sft`. Servers come from `rollout.backend` (launched when it is
`tandem:dN` without addresses; SGLang/vLLM servers are used by address), trainer workers from
`actor.backend` (one SPMD group); the scheduler (`scheduler.type`: local, ray or slurm) tears everything down on exit or Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.config.alloc import Component, parse_allocation_of_kind
from tandem.fleet.adapters import VLLM_LORA_NAME, vllm_base_name
from tandem.launch import vllm
from tandem.launch.affinity import ENV_CPUS
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.launch.scheduler import RunProcesses, ServerHandle
from tandem.rl.config import TandemConfig
from tandem.train.config import DETERMINISTIC_ENV
from tandem.train.controller import TrainController
from tandem.train.worker import EngineRole

logger = logging.getLogger("tandem.run")


def run_processes(cfg: TandemConfig) -> RunProcesses:
    """What the run's scheduler will start (a private Ray cluster is sized to hold it): the
    servers `rollout.backend` launches (none when `rollout.servers` lists them; `tandem sft`: the
    one evaluation server, unless `task.eval_size` is 0) and the trainer ranks of `actor.backend`,
    plus `critic.backend`'s when the critic has a group of its own, and the launched servers of a
    teacher, a reward model and a judge (`tandem sft sft.objective=reward`: no server)."""
    ranks = parse_allocation_of_kind(cfg.actor.backend, "actor.backend", inference=False).components[0].sizes
    count = ranks.world_size
    if cfg.command == "sft":  # a reward model is evaluated by its trainer ranks, not by a server
        evaluated = cfg.task.eval_size and cfg.sft.objective == "lm"
        return RunProcesses(servers=1 if evaluated else 0, ranks=count)
    if cfg.algo.ppo.use_critic and cfg.critic.backend:
        critic = parse_allocation_of_kind(cfg.critic.backend, "critic.backend", inference=False).components[0]
        count += critic.sizes.world_size
    servers = cfg.rollout.allocation.components[0].sizes.dp if cfg.rollout.launched_by_tandem else 0
    for scoring in (cfg.teacher, cfg.reward_model, cfg.judge):
        if scoring.enabled and scoring.launched_by_tandem:
            servers += scoring.allocation.components[0].sizes.dp
    return RunProcesses(servers=servers, ranks=count)


def start_workers(cfg: TandemConfig, scheduler: ProcessScheduler, alloc: Component | None = None, *,
                  role: EngineRole = "actor") -> TrainController:
    """A trainer group: `actor.backend`'s ranks with the actor's engine initialised on every rank,
    or `alloc`'s ranks for `role` (named after it, no engine yet: `initialize`). The actor's
    thread, core-pinning and determinism settings apply to every group."""
    comp = alloc or parse_allocation_of_kind(cfg.actor.backend, "actor.backend", inference=False).components[0]
    env = {}
    if cfg.actor.num_threads:
        env["OMP_NUM_THREADS"] = str(cfg.actor.num_threads)
    if cfg.actor.cpus:
        env[ENV_CPUS] = cfg.actor.cpus
    if cfg.actor.deterministic:  # before the ranks' process group exists (NCCL reads them then)
        env.update({k: os.environ.get(k, v) for k, v in DETERMINISTIC_ENV.items()})
    trainer = TrainController.start(scheduler, comp, name=role, device=cfg.experiment.device, env=env,
                                    timeout_s=cfg.scheduler.start_timeout_s, role=role)
    if alloc is not None:
        return trainer
    began = time.monotonic()
    ranks = trainer.initialize(cfg.actor)
    logger.info("actor: engine ready on %d rank(s) (%s, %s parameters on rank 0) after %.1f s", len(ranks),
                cfg.actor.dtype, f"{ranks[0].local_params:,}", time.monotonic() - began)
    return trainer


@dataclass
class InferenceServers:
    addresses: list[str]  # URLs
    launched: bool
    api_key: str | None  # what every request to the servers carries
    handles: list[ServerHandle] = field(default_factory=list)  # the launched ones
    server_args: list[str] = field(default_factory=list)  # what they were started with


def start_servers(cfg: TandemConfig, scheduler: ProcessScheduler, model_path: str, *,
                  weights_dir: Path | None = None) -> InferenceServers:
    """The run's inference servers: launched for `tandem:dN` (each requiring the run's API key,
    `rollout.api_key` or a fresh per-run key, handed over in the environment where other users
    cannot read it; disk updates allowed from `weights_dir`), else the listed addresses."""
    if not cfg.rollout.launched_by_tandem:
        return InferenceServers(list(cfg.rollout.servers), launched=False, api_key=cfg.rollout.api_key)
    comp = cfg.rollout.allocation.components[0]
    api_key = cfg.rollout.api_key or secrets.token_urlsafe(32)
    if comp.backend == "vllm":
        return _start_vllm(cfg, scheduler, model_path, comp.sizes.dp, comp.sizes.tp, api_key)
    env = {ENV_CPUS: cfg.rollout.cpus} if cfg.rollout.cpus else None
    server_args = list(cfg.rollout.server_args)
    if weights_dir is not None:
        server_args += ["--weights-dir", str(weights_dir)]
    handles = scheduler.start_servers(comp, model_path, server_args=server_args, device=cfg.experiment.device,
                                      env=env, api_key=api_key, timeout_s=cfg.scheduler.start_timeout_s)
    return InferenceServers([h.url for h in handles], launched=True, api_key=api_key, handles=handles,
                            server_args=server_args)


def _start_vllm(cfg: TandemConfig, scheduler: ProcessScheduler, model_path: str, count: int, tp: int,
                api_key: str) -> InferenceServers:
    """`count` vLLM servers (`rollout.vllm`) of `tp` tensor-parallel workers each, each requiring
    `api_key` on its OpenAI routes (VLLM_API_KEY, in the environment); the model's dtype is the
    trainer's. With `rollout.vllm.lora_rank` they start with LoRA and serve the base under a name of
    its own (`vllm_base_name`), the adapter's name being what generation asks for."""
    v = cfg.rollout.vllm
    env = {"VLLM_API_KEY": api_key, **({ENV_CPUS: cfg.rollout.cpus} if cfg.rollout.cpus else {})}
    served = cfg.rollout.model
    if v.lora_rank:
        served = vllm_base_name(cfg.rollout.model or VLLM_LORA_NAME)
    specs = vllm.specs_for(count, v.interpreter(), model_path, dtype=cfg.actor.dtype, lora_rank=v.lora_rank or None,
                           served_model_name=served, max_model_len=v.max_model_len,
                           kv_cache_gib=v.kv_cache_gib, threads=v.threads or None, worker_extension=v.worker_extension,
                           enforce_eager=v.enforce_eager, tensor_parallel_size=tp, extra_args=list(v.args))
    began = time.monotonic()
    handles = vllm.start_servers(scheduler, specs, env=env, timeout_s=v.start_timeout_s)
    logger.info("rollout: %d vLLM server(s) healthy after %.1f s", len(handles), time.monotonic() - began)
    return InferenceServers([h.url for h in handles], launched=True, api_key=api_key, handles=handles)
