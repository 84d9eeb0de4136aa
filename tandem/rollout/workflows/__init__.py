"""Built-in workflows: RLVR (n samples per prompt, verifiable reward), multi-turn, and groups of
episodes of one item (`GroupWorkflow`)."""

from tandem.rollout.workflows.group import GroupWorkflow
from tandem.rollout.workflows.multi_turn import Feedback, MultiTurnWorkflow, RewardFeedback
from tandem.rollout.workflows.rlvr import RLVRWorkflow, prompt_ids_of

__all__ = ["Feedback", "GroupWorkflow", "MultiTurnWorkflow", "RLVRWorkflow", "RewardFeedback", "prompt_ids_of"]
