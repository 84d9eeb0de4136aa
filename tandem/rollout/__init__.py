"""Rollouts: inference client over a server pool, workflows, rewards, staleness bound, executor."""

from tandem.data.trajectory import Trajectory, stack_group
from tandem.fleet.generation import GenerationParams
from tandem.fleet.routed_experts import RoutedExpertLayout
from tandem.lazy import lazy_attributes
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
from tandem.rollout.types import ModelRequest, ModelResponse
from tandem.rollout.workflows import Feedback, MultiTurnWorkflow, RLVRWorkflow, RolloutWorkflow

# The controller side pulls in FastAPI/uvicorn and the callback pulls in torch (tandem.weights): load
# them on first use, so rollout worker processes and plain executor users do not pay for them.
_LAZY = {
    "RolloutCallback": "tandem.rollout.callback",
    "RolloutConfig": "tandem.rollout.config",
    "RolloutController": "tandem.rollout.controller",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "ClientConfig", "ExecutorConfig", "Feedback", "GenerationDeadlineError", "GenerationParams",
    "InferenceClient", "ModelRequest", "ModelResponse", "MultiTurnWorkflow", "NoServerError",
    "PromptTooLongError", "RLVRWorkflow", "RewardResult", "RewardRunner", "RolloutCallback", "RolloutConfig",
    "RolloutController", "RolloutError", "RolloutWorkflow", "RoutedExpertLayout", "ServerPool", "ServerRequestError", "StalenessManager", "Trajectory",
    "WorkflowExecutor", "stack_group",
]
