"""Built-in workflows: RLVR (n samples per prompt, verifiable reward) and multi-turn."""

from tandem.rollout.workflows.multi_turn import Feedback, MultiTurnWorkflow
from tandem.rollout.workflows.rlvr import RLVRWorkflow, prompt_ids_of

__all__ = ["Feedback", "MultiTurnWorkflow", "RLVRWorkflow", "prompt_ids_of"]
