"""The training engine: packed micro-batches, FSDP2, checkpoints and weight export.

    engine = TrainEngine(TrainEngineConfig(path="models/qwen3-tiny"))
    stats = engine.train_batch(SequenceBatch.from_token_lists(ids, loss_mask=masks), sft_loss)
"""

from tandem.train.batch import MicroBatch, SequenceBatch, shift_to_next_token
from tandem.train.config import MicroBatchConfig, TrainEngineConfig
from tandem.train.engine import TokenOutputs, TrainEngine
from tandem.train.losses import LossFn, LossWeightFn, count_loss_tokens, loss_mask_of, sft_loss
from tandem.train.microbatch import plan_micro_batches, restore_order
from tandem.train.optim import LRSchedule, build_optimizer, clip_grad_norm

__all__ = [
    "LRSchedule",
    "LossFn",
    "LossWeightFn",
    "MicroBatch",
    "MicroBatchConfig",
    "SequenceBatch",
    "TokenOutputs",
    "TrainEngine",
    "TrainEngineConfig",
    "build_optimizer",
    "clip_grad_norm",
    "count_loss_tokens",
    "loss_mask_of",
    "plan_micro_batches",
    "restore_order",
    "sft_loss",
    "shift_to_next_token",
]
