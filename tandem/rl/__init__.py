"""The RL loop: `tandem train` (asynchronous RL) and `tandem sft` (warm start), tying together the
launcher, the inference fleet, the rollout controller, the trainer workers and weight sync."""
