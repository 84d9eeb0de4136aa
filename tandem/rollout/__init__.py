"""Rollouts: inference client over a server pool, workflows, rewards, staleness bound, executor."""

from tandem.data.trajectory import Trajectory, stack_group
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.errors import (
    GenerationDeadlineError,
    NoServerError,
    PromptTooLongError,
    RolloutError,
    ServerRequestError,
)
from tandem.rollout.executor import ExecutorConfig, WorkflowExecutor
from tandem.rollout.pool import ServerPool
from tandem.rollout.reward import RewardResult, RewardRunner
from tandem.rollout.staleness import StalenessManager
from tandem.rollout.types import GenerationParams, ModelRequest, ModelResponse
from tandem.rollout.workflow import RolloutWorkflow
from tandem.rollout.workflows import Feedback, MultiTurnWorkflow, RLVRWorkflow

__all__ = [
    "ClientConfig", "ExecutorConfig", "Feedback", "GenerationDeadlineError", "GenerationParams",
    "InferenceClient", "ModelRequest", "ModelResponse", "MultiTurnWorkflow", "NoServerError",
    "PromptTooLongError", "RLVRWorkflow", "RewardResult", "RewardRunner", "RolloutError",
    "RolloutWorkflow", "ServerPool", "ServerRequestError", "StalenessManager", "Trajectory",
    "WorkflowExecutor", "stack_group",
]
