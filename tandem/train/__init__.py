"""The training engine: packed micro-batches, FSDP2, checkpoints and weight export; the trainer
rank's RPC surface (`TrainWorker`) and the controller's handle on a trainer group
(`TrainController`).

    engine = TrainEngine(TrainEngineConfig(path="models/qwen3-tiny"))
    stats = engine.train_batch(SequenceBatch.from_token_lists(ids, loss_mask=masks), sft_loss)
"""

from tandem.lazy import lazy_attributes

# Loaded on first use: `TrainEngineConfig` is the run config's `actor` section, whose loading
# (`show-config`, the checks before a run) must not import torch.
_LAZY = {
    "MicroBatch": "tandem.data.batch", "SequenceBatch": "tandem.data.batch",
    "shift_to_next_token": "tandem.data.batch",
    "MicroBatchConfig": "tandem.train.config", "OptimizerConfig": "tandem.train.config",
    "TrainEngineConfig": "tandem.train.config",
    "TrainController": "tandem.train.controller",
    "TokenOutputs": "tandem.train.engine", "TrainEngine": "tandem.train.engine",
    "LossFn": "tandem.train.losses", "LossWeightFn": "tandem.train.losses",
    "count_loss_tokens": "tandem.data.batch", "loss_mask_of": "tandem.data.batch", "sft_loss": "tandem.train.losses",
    "plan_micro_batches": "tandem.train.microbatch", "restore_order": "tandem.train.microbatch",
    "LRSchedule": "tandem.train.optim", "build_optimizer": "tandem.train.optim", "clip_grad_norm": "tandem.train.optim",
    "TrainWorker": "tandem.train.worker",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "LRSchedule",
    "LossFn",
    "LossWeightFn",
    "MicroBatch",
    "MicroBatchConfig",
    "OptimizerConfig",
    "SequenceBatch",
    "TokenOutputs",
    "TrainController",
    "TrainEngine",
    "TrainEngineConfig",
    "TrainWorker",
    "build_optimizer",
    "clip_grad_norm",
    "count_loss_tokens",
    "loss_mask_of",
    "plan_micro_batches",
    "restore_order",
    "sft_loss",
    "shift_to_next_token",
]
