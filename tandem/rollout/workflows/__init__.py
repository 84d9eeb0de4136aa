"""Workflows: what one episode is. `base` is the interface (`RolloutWorkflow`); built in: RLVR (n
samples per prompt, verifiable reward), multi-turn, groups of episodes of one item
(`GroupWorkflow`) and the agent workflow (`agent`: the user's agent function through the agent
proxy, `tandem.rollout.agent`); `build` makes the one `rollout.workflow` names."""

from tandem.lazy import lazy_attributes
from tandem.rollout.workflows.base import EpisodeResult, RolloutWorkflow, as_trajectories
from tandem.rollout.workflows.group import GroupWorkflow
from tandem.rollout.workflows.multi_turn import Feedback, MultiTurnWorkflow, RewardFeedback
from tandem.rollout.workflows.rlvr import RLVRWorkflow, prompt_ids_of

# The agent workflow pulls in its proxy (FastAPI): load it on first use.
_LAZY = {
    "AgentWorkflow": "tandem.rollout.workflows.agent",
    "build_workflow": "tandem.rollout.workflows.build",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "AgentWorkflow", "EpisodeResult", "Feedback", "GroupWorkflow", "MultiTurnWorkflow", "RLVRWorkflow",
    "RewardFeedback", "RolloutWorkflow", "as_trajectories", "build_workflow", "prompt_ids_of",
]
