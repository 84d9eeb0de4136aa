"""Every key `tandem show-config --keys` lists is tested (issue 26, item 4).

`KEY_TESTS` maps each listed key to pytest node ids of tests that show its effect (what Tandem
does changes when the key changes) or its refusal (a bad value is refused with a message naming
the key). A key that does nothing has no place in the schema: it is removed, not listed here.
The meta-tests below keep the table equal to the keys the command lists (a new key fails until it
has a test and an entry) and check that every node id names a test that exists.

Node ids are `path::function` (every parametrisation), `path::Class::method`, or
`path::function[id]` for one parametrisation with an explicit id (`pytest.param(..., id="...")`, a
literal `ids=[...]`, or the value of a single string argument), which the check below reads from
the test's source, so it needs neither pytest's collection nor the test modules' imports.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tandem.config.keys_doc import keys_markdown
from tandem.rl.config import TandemConfig, load_run_config

REPO = Path(__file__).resolve().parents[2]

# Keys another engineer is adding or changing under issue 26 (the critic, the reference model and
# the PPO settings that use them); their tests and entries come with that work. Entries ending in
# "." cover every key below that section. Empty this set once those entries are in KEY_TESTS.
PENDING_ISSUE_26: frozenset[str] = frozenset()  # issue 26 landed: its keys are in the table

T_VALIDATION = "tests/config/test_validation.py::test_refused_at_load_naming_the_key"
T_DASHBOARD_KEPT = "tests/dashboard/test_run_keys.py::test_trajectories_per_step_and_trainer_logprobs_choose_what_is_kept_and_scored"
T_VALIDATION_DASHBOARD = "tests/dashboard/test_run_keys.py::test_fleet_interval_s_sets_how_often_the_fleet_is_recorded"
T_LOADER_CHOICES = "tests/config/test_loader.py::test_choices_and_minimum"
T_TRIAL_DIR = "tests/rl/test_trial.py::test_a_fresh_trial_starts_at_zero"
T_OPTIMIZER = "tests/train/test_engine_config_keys.py::test_optimizer_keys_change_the_updates"
T_SCHEDULE = "tests/train/test_engine_config_keys.py::test_schedule_keys_shape_the_learning_rate"
T_AC = "tests/train/test_engine_config_keys.py::test_activation_checkpointing_recomputes_what_the_keys_say"
T_COMPILE = "tests/train/test_engine_config_keys.py::test_memory_budget_and_compile_reach_the_blocks"
T_PIPELINE = "tests/train/test_pipeline_keys.py::test_pipeline_keys_choose_the_schedule_stages_and_micro_batches"
T_PLANS = "tests/train/test_microbatch.py::test_plans_respect_budget_and_counts"
T_ROUTER = "tests/train/test_router_replay.py"
T_LAUNCH_RANKS = "tests/rl/test_launch_keys.py::test_trainer_ranks_start_as_the_actor_keys_say"
T_LAUNCH_SERVERS = "tests/rl/test_launch_keys.py::test_launched_servers_take_the_rollout_keys"
T_LAUNCH_VLLM = "tests/rl/test_launch_keys.py::test_launched_vllm_servers_take_the_vllm_keys"
T_CAPACITY = "tests/rollout/test_config_keys.py::test_staleness_keys_bound_the_episodes_that_may_start"
T_REACH = "tests/rollout/test_config_keys.py::test_keys_reach_the_executor_and_the_fleet"
T_HEALTH = "tests/rollout/test_config_keys.py::test_health_timeout_s_and_failure_threshold_evict_a_hung_server"
T_AGENT_CLIENT = "tests/rollout/test_agent_config_keys.py::test_the_agent_gets_the_configured_client_and_proxy"
T_AGENT_WORKFLOW = "tests/rollout/test_agent_proxy.py::test_the_agent_workflow_runs_groups_and_reports_agents_that_fail"
T_WORKFLOWS = "tests/rl/test_workflows.py"
T_MULTI_TURN = f"{T_WORKFLOWS}::test_multi_turn_is_a_group_of_conversations_fed_back_by_the_reward"
T_GENERATION = "tests/rl/test_run_keys.py::test_generation_keys_are_the_workflows_sampling"
T_DATA = "tests/rl/test_run_keys.py::test_task_and_seed_keys_shape_the_data"
T_UPDATE_META = "tests/rl/test_run_keys.py::test_weight_update_keys_make_the_runs_update"
T_BATCH = "tests/algo/test_config_keys.py::test_the_key_changes_the_training_batch"
T_LOSS = "tests/algo/test_config_keys.py::test_the_key_changes_the_policy_loss"
T_E2E_STALENESS = "tests/rl/test_train_e2e.py::test_staleness_zero_gives_ratio_one_and_no_mismatch"
T_E2E_ASYNC = "tests/rl/test_train_e2e.py::test_the_default_asynchronous_loop_keeps_its_bound_and_learns"
T_TRACKERS_E2E = "tests/rl/test_trackers.py::test_a_run_reaches_wandb_offline_and_mlflow"
T_TRACKERS_SFT = "tests/rl/test_trackers.py::test_sft_rows_reach_both_trackers"
T_TRACKERS_REFUSED = "tests/rl/test_trackers.py::test_bad_tracker_settings_are_refused_naming_the_key"
T_TRACKERS_MISSING = "tests/rl/test_trackers.py::test_a_tracker_that_is_not_installed_is_named_with_how_to_install_it"
T_TRAINING_BATCH_TEACHER = "tests/rl/test_training_batch.py"
T_TEACHER_REFUSED = "tests/rl/test_distill.py::test_teacher_settings_are_refused_naming_the_key"
T_TEACHER_TOKENIZER = "tests/rl/test_distill.py::test_a_teacher_with_another_tokenizer_is_refused_naming_both"
T_TEACHER_LAUNCH = "tests/rl/test_distill.py::test_launched_teacher_servers_take_the_teacher_keys"
T_DISTILL_E2E = "tests/rl/test_distill_e2e.py::test_distillation_survives_a_dead_teacher_server"
T_RM_REFUSED = "tests/rl/test_reward_model_run.py::test_reward_model_settings_are_refused_naming_the_key"
T_RM_CHECK = "tests/rl/test_reward_model_run.py::test_the_pre_launch_check_wants_a_one_label_classifier_with_the_actors_tokenizer"
T_RM_LAUNCH = "tests/rl/test_reward_model_run.py::test_launched_reward_servers_take_the_reward_model_keys"
T_RM_E2E = "tests/rl/test_reward_model_run.py::test_a_run_rewarded_by_a_model_survives_a_dead_reward_server"
T_JUDGE_REFUSED = "tests/rl/test_judge_run.py::test_judge_settings_are_refused_naming_the_key"
T_JUDGE_CHECK = "tests/rl/test_judge_run.py::test_the_pre_launch_check_wants_a_causal_lm"
T_JUDGE_LAUNCH = "tests/rl/test_judge_run.py::test_launched_judge_servers_take_the_judge_keys"
T_JUDGE_E2E = "tests/rl/test_judge_run.py::test_a_run_rewarded_by_a_judge"
T_JUDGE_SCORE = "tests/rollout/test_judge.py::test_verdicts_become_rewards_with_the_raw_text_kept"
T_ELASTIC_DISK = "tests/rl/test_elastic_run.py::test_a_server_killed_in_an_update_phase_leaves_the_run_going"  # [disk]
T_SECOND_LAUNCH = "tests/rl/test_run_lifecycle.py::test_second_launch_into_a_trial"
T_SFT = "tests/rl/test_calculator_sft.py::test_sft_trains_on_conversations_and_evaluates_with_the_tool_loop"
T_REWARD_FILE = "tests/rl/test_reward_workflow_e2e.py::test_a_reward_from_a_file_scores_training_and_evaluation"
T_SLURM = "tests/launch/test_slurm_config.py::test_slurm_keys_are_on_every_srun"
T_RAY = "tests/launch/test_ray_scheduler.py::test_ranks_as_ray_actors_and_an_actor_death"
T_ROLLOUT_KEYS = "tests/rollout/test_config_keys.py"
T_PPO_REACH = "tests/rl/test_ppo_config.py::test_critic_and_reference_keys_reach_their_engines"
T_PPO_REFUSED = "tests/rl/test_ppo_config.py::test_critic_and_reference_paths_are_checked"
T_PPO_MODELS = "tests/rl/test_ppo_models.py::test_reference_and_critic_beside_a_two_rank_actor"
T_CRITIC_SAVED = "tests/train/test_critic_engine.py::test_a_saved_critic_is_an_hf_token_classifier_with_the_same_values"
T_SANDBOX = "tests/sandbox/test_sandbox.py"
T_HOSTILE = "tests/sandbox/test_hostile.py"
T_TRAINING_BATCH = "tests/rl/test_training_batch.py::test_kl_reward_and_gae_on_the_critics_values"

KEY_TESTS: dict[str, tuple[str, ...]] = {
    # --- experiment
    "experiment.name": (T_TRIAL_DIR, T_VALIDATION),
    "experiment.trial": (T_TRIAL_DIR, T_VALIDATION),
    "experiment.seed": (T_DATA, f"{T_WORKFLOWS}::test_rlvr_is_the_default",
                        "tests/rl/test_run_config.py::test_actor_is_the_engine_config_with_derived_values"),
    "experiment.fileroot": (T_TRIAL_DIR,),
    "experiment.device": ("tests/rl/test_run_config.py::test_actor_is_the_engine_config_with_derived_values",
                          T_UPDATE_META),
    # --- actor: the training engine
    "actor.path": ("tests/train/test_engine.py::test_weight_export_buckets_match_save_model",
                   "tests/config/test_validation.py::test_actor_path_must_be_a_model_directory"),
    "actor.dtype": ("tests/train/test_engine.py::test_bf16_compute_dtype", T_LOADER_CHOICES),
    "actor.optimizer.lr": (f"{T_OPTIMIZER}[actor.optimizer.lr]", "tests/train/test_engine.py::test_stats"),
    "actor.optimizer.weight_decay": (f"{T_OPTIMIZER}[actor.optimizer.weight_decay]",),
    "actor.optimizer.beta1": (f"{T_OPTIMIZER}[actor.optimizer.beta1]",),
    "actor.optimizer.beta2": (f"{T_OPTIMIZER}[actor.optimizer.beta2]", T_VALIDATION),
    "actor.optimizer.eps": (f"{T_OPTIMIZER}[actor.optimizer.eps]",),
    "actor.optimizer.gradient_clipping": ("tests/train/test_engine_config_keys.py::test_gradient_clipping_scales_the_update",),
    "actor.optimizer.lr_scheduler": (T_SCHEDULE, "tests/train/test_engine.py::test_lr_schedules", T_LOADER_CHOICES),
    "actor.optimizer.warmup_steps_proportion": (T_SCHEDULE, T_VALIDATION),
    "actor.optimizer.min_lr_ratio": (T_SCHEDULE,),
    "actor.mb.max_tokens_per_mb": (T_PLANS, "tests/train/test_microbatch.py::test_sequence_over_budget_is_an_error",
                                   "tests/train/test_engine.py::test_ffd_vs_kk_packing"),
    "actor.mb.n_mbs": (T_PLANS, "tests/train/test_microbatch.py::test_more_micro_batches_than_sequences_pads"),
    "actor.mb.n_mbs_divisor": ("tests/train/test_microbatch.py::test_the_count_is_rounded_up_to_the_divisor",),
    "actor.mb.packing": ("tests/train/test_microbatch.py::test_packing_choice_changes_the_plan",
                         "tests/train/test_microbatch.py::test_sequence_over_budget_is_an_error"),
    "actor.parallelize.activation_checkpoint": (
        T_AC, T_VALIDATION,
        "tests/train/test_device_defaults.py::test_cpu_defaults_are_unchanged_and_cuda_gets_compile_and_op_level_"
        "selective_checkpointing"),
    "actor.parallelize.ac_selective": (T_AC,),
    "actor.parallelize.ac_every": (T_AC, "tests/train/test_engine.py::test_engine_refuses_an_invalid_config_naming_the_key"),
    "actor.parallelize.ac_debug": ("tests/parallel/test_parallel.py::test_ac_debug_logs_what_each_block_saves_and_recomputes",
                                   "tests/parallel/test_parallel.py::test_ac_debug_names_the_blocks_layer_level_leaves_alone",
                                   "tests/parallel/test_parallel.py::test_ac_debug_needs_checkpointed_eager_blocks",
                                   "tests/rl/test_areal_example.py::test_the_documents_example_converts_and_trains"),
    "actor.parallelize.ac_memory_budget": (T_COMPILE,
                                           "tests/train/test_engine.py::test_memory_budget_checkpointing_through_compile"),
    "actor.parallelize.compile": (T_COMPILE,
                                  "tests/train/test_device_defaults.py::test_cuda_defaults_step_aside_for_what_a_layout_"
                                  "cannot_run",
                                  "tests/parallel/test_tensor_parallel.py::test_run_config_refuses_indivisible_tp_at_load"),
    "actor.parallelize.reshard_after_forward": (
        "tests/train/test_engine_config_keys.py::test_reshard_after_forward_frees_the_blocks_it_says",),
    "actor.parallelize.pp_schedule": (T_PIPELINE, "tests/parallel/test_pipeline.py::test_schedule_names_short_and_any_case"),
    "actor.parallelize.pp_microbatches": (T_PIPELINE,
                                          "tests/parallel/test_pipeline.py::test_microbatches_raised_to_stages_with_a_warning"),
    "actor.parallelize.pp_stages_per_rank": (T_PIPELINE,
                                             "tests/parallel/test_pipeline.py::test_stages_per_rank_follow_the_schedule"),
    "actor.parallelize.offload_params": (
        "tests/train/test_engine_config_keys.py::test_offload_params_keeps_parameters_in_host_memory",
        "tests/train/test_engine.py::test_offload_is_refused_on_a_cpu_run_with_the_reason", T_VALIDATION),
    "actor.balance": ("tests/rl/test_dispatch.py::test_the_cost_chooses_the_split_and_the_stats_measure_both",
                      "tests/rl/test_dispatch.py::test_trainer_models_split_by_actor_balance",
                      "tests/rl/test_dispatch.py::test_bad_values_are_refused_naming_actor_balance",
                      "tests/train/test_microbatch.py::test_kk_packing_evens_the_balance_cost_under_the_token_budget",
                      "tests/train/test_engine.py::test_balance_chooses_the_cost_kk_packing_evens"),
    "actor.dp_replicate": ("tests/parallel/test_parallel.py::test_hsdp_world4_matches_one_rank",
                           "tests/rl/test_run_config.py::test_dp_replicate_must_divide_the_trainer_ranks"),
    "actor.deterministic": ("tests/train/test_engine.py::test_deterministic_mode_sets_the_environment",
                            "tests/train/test_device_defaults.py::test_deterministic_mode_warns_on_cuda_and_fails_on_cpu"),
    "actor.lora.rank": ("tests/train/test_lora.py::test_two_steps_equal_peft_and_adamw",
                        "tests/train/test_lora.py::test_base_frozen_in_the_compute_dtype_and_optimizer_state_for_adapters_only",
                        "tests/weights/test_lora_update.py::test_adapter_updates_reach_every_server_exactly"),
    "actor.lora.alpha": ("tests/train/test_lora.py::test_saved_adapter_loads_in_peft_with_the_engines_logits",
                         "tests/train/test_lora.py::test_two_steps_equal_peft_and_adamw"),
    "actor.lora.dropout": ("tests/train/test_lora.py::test_dropout_acts_in_training_forwards_only",),
    "actor.lora.target_modules": ("tests/train/test_lora.py::test_start_from_an_adapter_and_refusals",
                                  "tests/train/test_lora.py::test_saved_adapter_loads_in_peft_with_the_engines_logits"),
    "actor.lora.path": ("tests/train/test_lora.py::test_start_from_an_adapter_and_refusals",),
    "actor.attention": ("tests/models/test_attention.py::test_a_model_planned_with_flex_gives_the_sdpa_logits",
                        "tests/train/test_device_defaults.py::test_an_attention_kernel_the_device_cannot_train_with_is_refused",
                        "tests/train/test_device_defaults.py::test_the_engine_runs_with_the_devices_choices_and_logs_them"),
    "actor.logprob_chunk_size": ("tests/train/test_engine_config_keys.py::test_logprob_chunk_size_splits_the_output_head",),
    "actor.dist_backend": ("tests/train/test_engine_config_keys.py::test_dist_backend_is_the_process_groups_backend",),
    "actor.router_replay": (
        f"{T_ROUTER}::test_r3_forward_uses_exactly_the_batch_routes_and_unknown_rows_route_live",
        f"{T_ROUTER}::test_r2_update_passes_replay_the_routes_the_proximal_pass_recorded",
        f"{T_ROUTER}::test_rollouts_ask_for_routes_when_they_are_used", f"{T_ROUTER}::test_router_replay_config_errors"),
    "actor.router_replay_live_mismatch": (
        f"{T_ROUTER}::test_r3_live_mismatch_is_the_live_forwards_and_mismatch_the_replayed_ones",
        f"{T_ROUTER}::test_live_mismatch_needs_r3"),
    "actor.moe_aux_loss_coef": (f"{T_ROUTER}::test_load_balancing_loss_reaches_the_router",
                                f"{T_ROUTER}::test_moe_options_are_refused_for_a_dense_model"),
    "actor.backend": ("tests/rl/test_parallel_train.py::test_rl_loop_under_a_model_parallel_layout",
                      "tests/config/test_loader.py::test_allocation_fields_are_checked", T_VALIDATION),
    "actor.num_threads": (T_LAUNCH_RANKS,),
    "actor.cpus": (T_LAUNCH_RANKS,),
    # --- rollout: servers, controller, client, executor, fleet
    "rollout.backend": (T_LAUNCH_SERVERS, T_LAUNCH_VLLM, "tests/config/test_loader.py::test_allocation_fields_are_checked",
                        T_VALIDATION),
    "rollout.servers": ("tests/rollout/test_controller.py::test_callback_fans_out_and_names_failing_servers",
                        "tests/config/test_loader.py::test_external_servers_must_be_listed"),
    "rollout.server_args": (T_LAUNCH_SERVERS, "tests/config/test_validation.py::test_server_args_are_checked"),
    "rollout.cpus": (T_LAUNCH_SERVERS,),
    "rollout.model": (f"{T_ROLLOUT_KEYS}::test_model_names_the_served_model_to_vllm", T_LAUNCH_VLLM),
    "rollout.api_key": (f"{T_ROLLOUT_KEYS}::test_api_key_is_sent_with_every_request", T_LAUNCH_SERVERS),
    "rollout.max_concurrent_rollouts": (f"{T_CAPACITY}[rollout.max_concurrent_rollouts]",
                                        "tests/rollout/test_staleness.py::test_fresh_v0_capped_by_concurrency"),
    "rollout.consumer_batch_size": (f"{T_CAPACITY}[rollout.consumer_batch_size]",
                                    "tests/rollout/test_executor.py::test_staleness_bound_holds_for_every_trajectory"),
    "rollout.max_head_offpolicyness": (f"{T_CAPACITY}[rollout.max_head_offpolicyness]",
                                       "tests/rollout/test_executor.py::test_staleness_bound_holds_for_every_trajectory",
                                       T_E2E_STALENESS,
                                       "tests/config/test_loader.py::test_async_without_off_policy_correction_is_refused"),
    "rollout.seed_sampling": (f"{T_WORKFLOWS}::test_rlvr_is_the_default",
                              "tests/rollout/test_routed_experts_wire.py::test_a_request_seed_reaches_every_server_kind_under_its_name",
                              "tests/config/test_reward_config.py::test_workflow_choices"),
    "rollout.max_consecutive_failures": (f"{T_REACH}[rollout.max_consecutive_failures]",
                                         "tests/rollout/test_executor.py::test_error_storm_ends_rollouts_with_the_first_error",
                                         "tests/rl/test_reward_workflow_e2e.py::test_a_raising_reward_ends_the_run_with_its_error"),
    "rollout.order": (f"{T_REACH}[rollout.order]", "tests/rollout/test_executor.py::test_hand_out_order"),
    "rollout.workers": ("tests/rollout/test_controller.py::test_rollout_workers_run_episodes_and_report_them",),
    "rollout.request_deadline_s": (f"{T_ROLLOUT_KEYS}::test_request_deadline_s_ends_a_hung_request", T_VALIDATION),
    "rollout.call_timeout_s": (f"{T_ROLLOUT_KEYS}::test_call_timeout_s_moves_a_hung_call_to_another_server",),
    "rollout.dump_dir": (f"{T_REACH}[rollout.dump_dir]", "tests/rollout/test_executor.py::test_rollout_batch_and_dumps",
                         "tests/rl/test_reward_workflow_e2e.py::test_multi_turn_asks_again_after_a_wrong_answer"),
    "rollout.workflow": (f"{T_WORKFLOWS}::test_rlvr_is_the_default", T_MULTI_TURN,
                         f"{T_WORKFLOWS}::test_agent_runs_the_configured_agent_function",
                         "tests/config/test_reward_config.py::test_workflow_choices"),
    "rollout.reward": (T_REWARD_FILE, "tests/config/test_reward_config.py::test_reward_mistakes_exit_2_naming_rollout_reward"),
    "rollout.multi_turn.max_turns": (
        T_MULTI_TURN, "tests/rollout/test_workflows.py::test_reward_feedback_stops_at_max_turns_and_fails_on_a_failed_reward",
        "tests/config/test_reward_config.py::test_workflow_choices"),
    "rollout.multi_turn.success_reward": (
        T_MULTI_TURN, "tests/rollout/test_workflows.py::test_reward_feedback_asks_again_after_a_wrong_answer"),
    "rollout.multi_turn.retry_message": (
        T_MULTI_TURN, "tests/rollout/test_workflows.py::test_reward_feedback_asks_again_after_a_wrong_answer"),
    "rollout.agent.entry": (f"{T_WORKFLOWS}::test_agent_runs_the_configured_agent_function",
                            f"{T_WORKFLOWS}::test_agent_entry_is_checked_when_the_config_loads"),
    "rollout.agent.export": (f"{T_WORKFLOWS}::test_agent_runs_the_configured_agent_function", T_AGENT_WORKFLOW,
                             "tests/rollout/test_agent_session.py::test_chains_take_the_longest_parent_and_export_concat_trains_every_turn"),
    "rollout.agent.discount": (T_AGENT_WORKFLOW, "tests/rollout/test_agent_session.py::test_rewards_discount_backwards_and_by_call_id"),
    "rollout.agent.max_calls": ("tests/rollout/test_agent_config_keys.py::test_max_calls_refuses_the_calls_beyond_it",),
    "rollout.agent.timeout_s": (T_AGENT_CLIENT, T_AGENT_WORKFLOW),
    "rollout.agent.client_max_retries": (T_AGENT_CLIENT,),
    "rollout.agent.proxy_host": (T_AGENT_CLIENT,),
    "rollout.callback_host": (f"{T_ROLLOUT_KEYS}::test_callback_host_and_port_are_where_the_controller_listens",),
    "rollout.callback_port": (f"{T_ROLLOUT_KEYS}::test_callback_host_and_port_are_where_the_controller_listens",
                              T_VALIDATION),
    "rollout.control_timeout_s": (f"{T_ROLLOUT_KEYS}::test_control_timeout_s_bounds_a_fleet_call",),
    "rollout.worker_start_timeout_s": (f"{T_ROLLOUT_KEYS}::test_worker_start_timeout_s_bounds_the_workers_start",),
    "rollout.health.interval_s": (f"{T_ROLLOUT_KEYS}::test_health_interval_s_sets_how_often_servers_are_probed",),
    "rollout.health.timeout_s": (T_HEALTH,),
    "rollout.health.failure_threshold": (T_HEALTH, f"{T_REACH}[rollout.health.failure_threshold]",
                                         "tests/rollout/test_membership.py::test_failed_probes_make_suspect_then_evicted"),
    "rollout.vllm.python": (T_LAUNCH_VLLM,),
    "rollout.vllm.max_model_len": (T_LAUNCH_VLLM,),
    "rollout.vllm.kv_cache_gib": (T_LAUNCH_VLLM,),
    "rollout.vllm.threads": (T_LAUNCH_VLLM,),
    "rollout.vllm.args": (T_LAUNCH_VLLM,),
    "rollout.vllm.start_timeout_s": (T_LAUNCH_VLLM,),
    "rollout.vllm.enforce_eager": (T_LAUNCH_VLLM, "tests/engines/test_vllm_train.py::test_train_with_a_launched_vllm_server"),
    "rollout.vllm.worker_extension": (
        T_LAUNCH_VLLM, f"{T_ROLLOUT_KEYS}::test_worker_extension_decides_how_vllm_servers_take_updates",
        "tests/config/test_loader.py::test_train_refuses_servers_that_cannot_take_its_weight_sync"),
    "rollout.min_servers": (f"{T_ROLLOUT_KEYS}::test_min_servers_holds_rollouts_back_until_enough_are_healthy",
                            "tests/rollout/test_elastic_rollout.py::test_too_few_servers_hold_rollouts_back_then_fail_the_run",
                            "tests/rl/test_train_e2e.py::test_when_every_server_died_the_run_ends_naming_them",
                            T_VALIDATION),
    "rollout.min_servers_grace_s": (
        f"{T_REACH}[rollout.min_servers_grace_s]",
        "tests/rollout/test_elastic_rollout.py::test_too_few_servers_hold_rollouts_back_then_fail_the_run",
        "tests/rl/test_train_e2e.py::test_when_every_server_died_the_run_ends_naming_them"),
    "rollout.topology_cooldown_s": (
        f"{T_REACH}[rollout.topology_cooldown_s]",
        "tests/rollout/test_membership.py::test_additions_wait_the_cooldown_so_a_burst_costs_one_rebuild"),
    "rollout.replace_dead": ("tests/rl/test_elastic_run.py::test_kill_join_and_replace_in_a_running_job",),
    # --- rollout.sandbox: limits of untrusted code (docs/security.md)
    "rollout.sandbox.workers": (f"{T_SANDBOX}::test_workers_run_at_once_each_as_its_slots_uid",),
    "rollout.sandbox.cpu_s": (f"{T_HOSTILE}::test_a_busy_loop_is_killed_at_the_cpu_limit",),
    "rollout.sandbox.wall_s": (f"{T_HOSTILE}::test_sleeping_past_the_wall_limit_is_killed",
                               f"{T_SANDBOX}::test_cli_prints_one_json_object"),
    "rollout.sandbox.memory_mb": (f"{T_SANDBOX}::test_memory_mb_bounds_an_allocation",
                                  f"{T_HOSTILE}::test_a_10_gb_allocation_fails_at_the_memory_limit",
                                  f"{T_HOSTILE}::test_processes_that_together_pass_the_memory_limit_are_killed"),
    "rollout.sandbox.processes": (f"{T_HOSTILE}::test_fork_bomb_is_stopped_at_the_process_limit",
                                  f"{T_SANDBOX}::test_threads_count_as_processes_and_fit_in_memory_mb"),
    "rollout.sandbox.output_bytes": (f"{T_HOSTILE}::test_100_mb_of_stdout_is_cut_at_the_output_limit",
                                     f"{T_SANDBOX}::test_stdin_reaches_the_program_and_output_bytes_cuts_stderr_too"),
    "rollout.sandbox.file_bytes": (f"{T_SANDBOX}::test_file_bytes_bounds_a_written_file_and_the_program",),
    "rollout.sandbox.uid_base": (f"{T_SANDBOX}::test_workers_run_at_once_each_as_its_slots_uid",
                                 f"{T_HOSTILE}::test_killing_its_parent_or_a_host_process_of_its_uid_does_nothing"),
    "rollout.sandbox.bwrap": (f"{T_SANDBOX}::test_a_missing_bwrap_is_refused_and_the_program_never_runs",
                              f"{T_SANDBOX}::test_a_bwrap_that_fails_its_self_test_is_refused"),
    # --- gen: sampling of rollouts
    "gen.n_samples": (T_GENERATION, f"{T_WORKFLOWS}::test_rlvr_is_the_default", "tests/rollout/test_workflows.py::test_rlvr_group"),
    "gen.max_new_tokens": (T_GENERATION, T_MULTI_TURN),
    "gen.temperature": (T_GENERATION, "tests/inference/test_sampler.py::test_draws_follow_the_filtered_distribution",
                        T_VALIDATION),
    "gen.top_p": (T_GENERATION, "tests/inference/test_sampler.py::test_draws_follow_the_filtered_distribution",
                  T_VALIDATION),
    "gen.top_k": (T_GENERATION, "tests/inference/test_sampler.py::test_draws_follow_the_filtered_distribution",
                  T_VALIDATION),
    # --- algo: reward shaping, advantages, the PPO loss
    "algo.reward.reward_bias": (f"{T_BATCH}[algo.reward.reward_bias]", "tests/algo/test_rewards.py::test_reward_bias_scale_clip"),
    "algo.reward.reward_scaling": (f"{T_BATCH}[algo.reward.reward_scaling]",
                                   "tests/algo/test_rewards.py::test_reward_bias_scale_clip"),
    "algo.reward.reward_clip": (f"{T_BATCH}[algo.reward.reward_clip]", "tests/algo/test_rewards.py::test_reward_bias_scale_clip"),
    "algo.reward.overlong_penalty.enabled": (f"{T_BATCH}[algo.reward.overlong_penalty.enabled]",
                                             "tests/algo/test_rewards.py::test_dapo_overlong_penalty"),
    "algo.reward.overlong_penalty.overlong_tokens": (f"{T_BATCH}[algo.reward.overlong_penalty.overlong_tokens]",
                                                     "tests/algo/test_rewards.py::test_dapo_overlong_penalty"),
    "algo.reward.overlong_penalty.factor": (f"{T_BATCH}[algo.reward.overlong_penalty.factor]",
                                            "tests/algo/test_rewards.py::test_dapo_overlong_penalty"),
    "algo.advantage.mean_level": (f"{T_BATCH}[algo.advantage.mean_level]",
                                  "tests/algo/test_advantages.py::test_batch_level_mean_std_and_mixed_levels"),
    "algo.advantage.std_level": (f"{T_BATCH}[algo.advantage.std_level]",
                                 "tests/algo/test_advantages.py::test_batch_level_mean_std_and_mixed_levels"),
    "algo.advantage.leave_one_out": (f"{T_BATCH}[algo.advantage.leave_one_out]",
                                     "tests/algo/test_advantages.py::test_rloo_worked_examples"),
    "algo.advantage.unbiased_std": (f"{T_BATCH}[algo.advantage.unbiased_std]",
                                    "tests/algo/test_advantages.py::test_grpo_group_mean_and_std"),
    "algo.advantage.eps": (f"{T_BATCH}[algo.advantage.eps]", "tests/algo/test_advantages.py::test_grpo_group_mean_and_std"),
    "algo.ppo.eps_clip": (f"{T_LOSS}[algo.ppo.eps_clip]", T_VALIDATION),
    "algo.ppo.eps_clip_higher": (f"{T_LOSS}[algo.ppo.eps_clip_higher]", "tests/algo/test_losses.py::test_asymmetric_clip_dapo"),
    "algo.ppo.dual_clip": (f"{T_LOSS}[algo.ppo.dual_clip]", "tests/algo/test_losses.py::test_dual_clip"),
    "algo.ppo.behave_imp_weight_cap": (f"{T_LOSS}[algo.ppo.behave_imp_weight_cap]",
                                       "tests/algo/test_losses.py::test_sequence_level_behaviour_weight"),
    "algo.ppo.behave_imp_weight_mode": (f"{T_LOSS}[algo.ppo.behave_imp_weight_mode]",
                                        "tests/algo/test_losses.py::test_cap_mask_vs_clamp",
                                        "tests/config/test_loader.py::test_async_without_off_policy_correction_is_refused"),
    "algo.ppo.behave_imp_weight_level": (f"{T_LOSS}[algo.ppo.behave_imp_weight_level]",
                                         "tests/algo/test_losses.py::test_sequence_level_behaviour_weight"),
    "algo.ppo.importance_level": (f"{T_LOSS}[algo.ppo.importance_level]", "tests/algo/test_losses.py::test_gspo_sequence_ratio"),
    "algo.ppo.prox_logp": (f"{T_LOSS}[algo.ppo.prox_logp]", "tests/algo/test_losses.py::test_loglinear_proximal_approximation"),
    "algo.ppo.dynamic_filtering": (f"{T_BATCH}[algo.ppo.dynamic_filtering]", "tests/algo/test_advantages.py::test_dynamic_filtering"),
    # --- task
    "task.name": (T_DATA, T_VALIDATION),
    "task.options": ("tests/rl/test_data.py::test_eval_set_has_no_repeated_problem", T_VALIDATION),
    "task.train_size": (T_DATA, "tests/rl/test_data.py::test_eval_set_has_no_repeated_problem"),
    "task.eval_size": (T_DATA, "tests/rl/test_data.py::test_eval_set_has_no_repeated_problem"),
    "task.system_prompt": (T_DATA,),
    "task.reward_timeout_s": ("tests/rollout/test_executor.py::test_reward_that_hangs_is_rejected_and_the_executor_goes_on",
                              "tests/rl/test_reward_workflow_e2e.py::test_a_reward_that_spins_on_some_items_times_out_there_and_the_run_completes"),
    "task.reward_workers": (T_REWARD_FILE,),
    # --- train: the RL loop
    "train.total_steps": (T_SECOND_LAUNCH, "tests/rl/test_trial.py::test_a_complete_trial_is_refused",
                          "tests/rl/test_run_config.py::test_actor_is_the_engine_config_with_derived_values"),
    "train.n_minibatches": ("tests/rl/test_run_config.py::test_actor_is_the_engine_config_with_derived_values",
                            f"{T_ROUTER}::test_r2_update_passes_replay_the_routes_the_proximal_pass_recorded"),
    "train.weight_sync": (T_UPDATE_META, T_ELASTIC_DISK,
                          "tests/config/test_loader.py::test_train_refuses_servers_that_cannot_take_its_weight_sync"),
    "train.bucket_mb": (T_UPDATE_META, "tests/train/test_engine.py::test_weight_export_buckets_match_save_model"),
    "train.verify_weights": ("tests/weights/test_transport.py::test_ping_pong_staging_keeps_atomicity",
                             "tests/config/test_loader.py::test_train_refuses_weight_verification_on_servers_without_checksums"),
    "train.eval_every": (T_E2E_STALENESS, T_E2E_ASYNC),
    "train.save_every": (T_SECOND_LAUNCH, T_SECOND_LAUNCH),
    "train.resume_from": ("tests/rl/test_trial.py::test_the_latest_checkpoint_is_resumed",
                          "tests/rl/test_trial.py::test_resume_from_a_directory_that_is_no_checkpoint",
                          T_SECOND_LAUNCH),
    "train.overwrite": ("tests/rl/test_trial.py::test_overwrite_replaces_rl_outputs_only",
                        "tests/rl/test_trial.py::test_outputs_without_a_checkpoint_are_refused", T_SECOND_LAUNCH),
    "train.keep_checkpoints": (T_E2E_ASYNC, "tests/rl/test_recovery.py::test_killed_anywhere_the_rerun_is_bit_identical"),
    # --- sft
    "sft.steps": (T_SFT, "tests/rl/test_run_config.py::test_sft_schedule_spans_sft_steps"),
    "sft.batch_size": (T_SFT,),
    "sft.output": (T_SFT,),
    "sft.objective": ("tests/rl/test_reward_sft.py::test_two_ranks_take_the_steps_one_rank_takes",
                      "tests/data/test_preferences.py::test_reward_objective_settings_are_refused_naming_the_key"),
    "sft.preferences": ("tests/rl/test_reward_sft.py::test_a_trained_reward_model_is_served_and_prefers_what_it_was_taught",),
    # --- stats
    "stats.progress": ("tests/rl/test_run_lifecycle.py::test_a_run_that_talks_binds_loopback_and_stops_on_ctrl_c",),
    "stats.tensorboard": ("tests/rl/test_run_keys.py::test_tensorboard_writes_event_files_only_when_asked", T_E2E_ASYNC,
                          T_E2E_STALENESS),
    "stats.plot": (T_E2E_ASYNC, T_E2E_STALENESS),
    "stats.wandb_project": (T_TRACKERS_E2E, T_TRACKERS_SFT, T_TRACKERS_MISSING),
    "stats.wandb_mode": (T_TRACKERS_E2E, T_TRACKERS_REFUSED),
    "stats.mlflow_tracking_uri": (T_TRACKERS_E2E, T_TRACKERS_SFT, T_TRACKERS_MISSING,
                                  "tests/rl/test_trackers.py::test_a_uri_mlflow_refuses_is_named"),
    "stats.mlflow_experiment": (T_TRACKERS_E2E, T_TRACKERS_SFT, T_TRACKERS_REFUSED),
    "dashboard.enabled": ("tests/dashboard/test_run_keys.py::test_enabled_records_the_run_and_off_writes_nothing",),
    "dashboard.trajectories_per_step": (T_DASHBOARD_KEPT, T_VALIDATION_DASHBOARD),
    "dashboard.trainer_logprobs": (T_DASHBOARD_KEPT, "tests/dashboard/test_browser.py::test_a_live_run_in_the_browser"),
    "dashboard.fleet_interval_s": (T_VALIDATION_DASHBOARD,
                                   "tests/dashboard/test_browser.py::test_a_live_run_in_the_browser"),
    # --- recover, cluster
    "recover.mode": ("tests/rl/test_trial.py::test_recover_modes",),
    "recover.retries": ("tests/rl/test_recovery.py::test_retries_relaunch_a_job_whose_trainer_rank_died",),
    "cluster.host_ip": (T_UPDATE_META, "tests/rl/test_two_hosts.py::test_train_across_two_hosts_with_distributed_sync",
                        T_VALIDATION),
    # --- scheduler
    "scheduler.type": ("tests/launch/test_slurm_config.py::test_scheduler_type_picks_the_scheduler",
                       "tests/launch/test_ray_scheduler.py::test_train_on_a_running_ray_cluster",
                       "tests/launch/test_slurm_scheduler.py::test_train_on_slurm_survives_a_cancelled_server"),
    "scheduler.start_timeout_s": (
        T_LAUNCH_RANKS, "tests/launch/test_slurm_scheduler.py::test_a_role_slurm_cannot_place_fails_at_its_deadline_saying_why"),
    "scheduler.ray.address": ("tests/launch/test_ray_scheduler.py::test_train_on_a_running_ray_cluster",),
    "scheduler.ray.strategy": (T_RAY,),
    "scheduler.ray.cpus_per_process": (T_RAY, "tests/launch/test_ray_sizing.py::test_the_sizing_rule"),
    "scheduler.ray.num_cpus": (T_RAY, "tests/launch/test_ray_sizing.py::test_the_sizing_rule",
                               "tests/launch/test_ray_scheduler.py::"
                               "test_the_demo_shape_starts_on_a_private_ray_on_this_machine"),
    "scheduler.ray.namespace": (T_RAY,),
    "scheduler.slurm.partition": (T_SLURM, "tests/launch/test_slurm_config.py::test_default_slurm_launch_names_no_partition_account_or_nodes"),
    "scheduler.slurm.account": (T_SLURM, "tests/launch/test_slurm_config.py::test_default_slurm_launch_names_no_partition_account_or_nodes"),
    "scheduler.slurm.server_nodes": (T_SLURM,),
    "scheduler.slurm.trainer_nodes": (T_SLURM,),
    "scheduler.slurm.cpus_per_task": (
        T_SLURM, "tests/launch/test_slurm_scheduler.py::test_a_role_slurm_cannot_place_fails_at_its_deadline_saying_why"),
    "scheduler.slurm.srun_args": (T_SLURM,),
    # PPO's critic and reference (issue 26): the keys reach the engines they configure
    # (T_PPO_REACH), whose behaviour the engine and PPO tests show.
    "critic.path": (f"{T_PPO_REACH}[critic.path]", T_CRITIC_SAVED, T_PPO_REFUSED),
    "critic.backend": (f"{T_PPO_MODELS}[own-rank]", f"{T_PPO_MODELS}[colocated]", T_VALIDATION, T_PPO_REFUSED),
    "critic.optimizer.lr": (f"{T_PPO_REACH}[critic.optimizer.lr]", f"{T_OPTIMIZER}[actor.optimizer.lr]"),
    "critic.optimizer.weight_decay": (f"{T_PPO_REACH}[critic.optimizer.weight_decay]", f"{T_OPTIMIZER}[actor.optimizer.weight_decay]"),
    "critic.optimizer.beta1": (f"{T_PPO_REACH}[critic.optimizer.beta1]", f"{T_OPTIMIZER}[actor.optimizer.beta1]"),
    "critic.optimizer.beta2": (f"{T_PPO_REACH}[critic.optimizer.beta2]", f"{T_OPTIMIZER}[actor.optimizer.beta2]"),
    "critic.optimizer.eps": (f"{T_PPO_REACH}[critic.optimizer.eps]", f"{T_OPTIMIZER}[actor.optimizer.eps]"),
    "critic.optimizer.gradient_clipping": (f"{T_PPO_REACH}[critic.optimizer.gradient_clipping]", "tests/train/test_engine_config_keys.py::test_gradient_clipping_scales_the_update"),
    "critic.optimizer.lr_scheduler": (f"{T_PPO_REACH}[critic.optimizer.lr_scheduler]", T_SCHEDULE),
    "critic.optimizer.warmup_steps_proportion": (f"{T_PPO_REACH}[critic.optimizer.warmup_steps_proportion]", T_SCHEDULE),
    "critic.optimizer.min_lr_ratio": (f"{T_PPO_REACH}[critic.optimizer.min_lr_ratio]", T_SCHEDULE),
    "ref.path": (f"{T_PPO_REACH}[ref.path]", T_PPO_REFUSED, T_VALIDATION),
    "algo.name": (f"{T_BATCH}[algo.name]", "tests/algo/test_config.py::test_recipes_settings", T_VALIDATION),
    "algo.advantage.gamma": (f"{T_BATCH}[algo.advantage.gamma]", "tests/algo/test_advantages.py::test_gae_three_tokens"),
    "algo.advantage.lam": (f"{T_BATCH}[algo.advantage.lam]", "tests/algo/test_advantages.py::test_gae_three_tokens"),
    "algo.ppo.kl_ctl": (f"{T_BATCH}[algo.ppo.kl_ctl]", T_TRAINING_BATCH, f"{T_PPO_MODELS}[colocated]"),
    "algo.ppo.kl_estimator": (f"{T_BATCH}[algo.ppo.kl_estimator]", "tests/algo/test_rewards.py::test_kl_estimators_and_clamp",
                              T_VALIDATION),
    "algo.ppo.kl_in_loss": (f"{T_BATCH}[algo.ppo.kl_in_loss]", "tests/algo/test_losses.py::test_kl_to_the_reference_in_the_loss",
                            T_VALIDATION),
    "algo.ppo.use_critic": (T_VALIDATION, f"{T_BATCH}[algo.name]", f"{T_PPO_MODELS}[colocated]"),
    "algo.ppo.value_eps_clip": ("tests/algo/test_losses.py::test_value_loss_clipping", T_VALIDATION),
    # On-policy distillation (issue 48): the teacher fleet and the KL term to it.
    "algo.distill.kl_coef": (f"{T_TRAINING_BATCH_TEACHER}::test_a_teacher_term_joins_grpos_advantages",
                             f"{T_TRAINING_BATCH_TEACHER}::test_distill_advantage_is_each_tokens_own_teacher_minus_student",
                             T_TEACHER_REFUSED, T_DISTILL_E2E,
                             "tests/rl/test_distill_learns.py::test_distillation_lowers_the_exact_reverse_kl"),
    "teacher.path": (T_TEACHER_REFUSED, T_TEACHER_TOKENIZER, T_TEACHER_LAUNCH, T_DISTILL_E2E),
    "teacher.backend": (T_TEACHER_LAUNCH, T_TEACHER_REFUSED, T_DISTILL_E2E),
    "teacher.servers": ("tests/rl/test_distill.py::test_listed_teacher_servers_are_used_as_they_are",),
    "teacher.server_args": (T_TEACHER_LAUNCH,),
    "teacher.cpus": (T_TEACHER_LAUNCH, T_TEACHER_REFUSED),
    "teacher.api_key": (T_TEACHER_LAUNCH,),
    "teacher.min_servers": (T_TEACHER_LAUNCH, T_TEACHER_REFUSED),
    "teacher.request_deadline_s": (T_TEACHER_LAUNCH, T_TEACHER_REFUSED,
                                   "tests/rollout/test_teacher.py::test_a_teacher_server_killed_while_scoring_loses_no_trajectory"),
    "teacher.call_timeout_s": (T_TEACHER_LAUNCH,),
    # A reward model as the run's reward (issue 48).
    "reward_model.path": (T_RM_REFUSED, T_RM_CHECK, T_RM_LAUNCH, T_RM_E2E),
    "reward_model.backend": (T_RM_LAUNCH, T_RM_REFUSED, T_RM_E2E),
    "reward_model.servers": ("tests/rollout/test_reward_model.py::test_rewards_are_the_models_scores",),
    "reward_model.server_args": (T_RM_LAUNCH,),
    "reward_model.cpus": (T_RM_LAUNCH,),
    "reward_model.api_key": (T_RM_LAUNCH,),
    "reward_model.min_servers": (T_RM_LAUNCH,),
    "reward_model.request_deadline_s": (T_RM_LAUNCH,
                                        "tests/rollout/test_reward_model.py::test_a_reward_server_killed_while_scoring_loses_no_episode"),
    "reward_model.call_timeout_s": (T_RM_LAUNCH,),
    "reward_model.mode": (T_RM_LAUNCH, T_RM_REFUSED, "tests/rollout/test_reward_model.py::test_rewards_are_the_models_scores"),
    "judge.path": (T_JUDGE_REFUSED, T_JUDGE_CHECK, T_JUDGE_LAUNCH, T_JUDGE_E2E),
    "judge.backend": (T_JUDGE_LAUNCH, T_JUDGE_REFUSED, T_JUDGE_E2E),
    "judge.servers": (T_JUDGE_SCORE,),
    "judge.server_args": (T_JUDGE_LAUNCH,),
    "judge.cpus": (T_JUDGE_LAUNCH,),
    "judge.api_key": (T_JUDGE_LAUNCH,),
    "judge.min_servers": (T_JUDGE_LAUNCH,),
    "judge.request_deadline_s": (T_JUDGE_LAUNCH,),
    "judge.call_timeout_s": (T_JUDGE_LAUNCH,),
    "judge.template": (T_JUDGE_LAUNCH, T_JUDGE_REFUSED, T_JUDGE_SCORE),
    "judge.parser": (T_JUDGE_LAUNCH, T_JUDGE_REFUSED, "tests/rollout/test_judge.py::test_a_verdict_the_parser_refuses_is_a_failed_reward"),
    "judge.max_new_tokens": (T_JUDGE_LAUNCH, T_JUDGE_REFUSED),
    "judge.mode": (T_JUDGE_LAUNCH, T_JUDGE_REFUSED, T_JUDGE_E2E),
}


def listed_keys() -> list[str]:
    """The keys of `tandem show-config --keys`: the rows of the same table it prints."""
    table = keys_markdown(TandemConfig, load_run_config(None))
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE)


def pending(key: str) -> bool:
    return key in PENDING_ISSUE_26 or any(p.endswith(".") and key.startswith(p) for p in PENDING_ISSUE_26)


def test_every_listed_key_has_a_test():
    """A key added to the schema without an entry here fails (add a test that shows its effect or
    its refusal, then the entry); a key that left the schema must leave the table too."""
    listed = listed_keys()
    assert len(listed) == len(set(listed)) and len(listed) > 100
    expected = {k for k in listed if not pending(k)}
    missing = sorted(expected - KEY_TESTS.keys())
    assert not missing, (f"config keys without a test: {missing}. Add a test that shows each key's effect (what "
                         "changes when the key changes) or its refusal (a bad value refused with a message naming "
                         "the key), then an entry in KEY_TESTS in tests/config/test_key_audit.py")
    gone = sorted(KEY_TESTS.keys() - set(listed))
    assert not gone, f"KEY_TESTS names keys `tandem show-config --keys` does not list: {gone}; remove those entries"
    both = sorted(k for k in KEY_TESTS if pending(k))
    assert not both, f"keys both in KEY_TESTS and PENDING_ISSUE_26: {both}; drop them from PENDING_ISSUE_26"
    assert all(KEY_TESTS[k] for k in KEY_TESTS), [k for k in KEY_TESTS if not KEY_TESTS[k]]


@cache
def _module(path: str) -> ast.Module:
    return ast.parse((REPO / path).read_text())


def _test_functions(path: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """`function` and `Class::method` names of the tests defined in a file -> their definitions."""
    found = {}
    for node in _module(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found.update({f"{node.name}::{f.name}": f for f in node.body
                          if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name.startswith("test")})
    return found


def _literal_values(path: str, node: ast.expr) -> list[ast.expr] | None:
    """The parametrisations of `argvalues`: a list or tuple written out, or a module-level list,
    tuple or dict (its keys) named directly or through `list(NAME)`; None for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Name):
        assigned = [a.value for a in _module(path).body if isinstance(a, ast.Assign | ast.AnnAssign) and any(
            isinstance(t, ast.Name) and t.id == node.id for t in (a.targets if isinstance(a, ast.Assign) else [a.target]))]
        if len(assigned) != 1 or assigned[0] is None:
            return None
        node = assigned[0]
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None]
    return list(node.elts) if isinstance(node, ast.List | ast.Tuple) else None


def _explicit_ids(path: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The ids a test's `pytest.mark.parametrize` gives its cases, read from the source (no import,
    no collection): `pytest.param(..., id="...")`, a literal `ids=[...]`, or the string value of a
    single argument. Cases whose id pytest would generate otherwise are not listed."""
    found: set[str] = set()
    for deco in function.decorator_list:
        if not (isinstance(deco, ast.Call) and ast.unparse(deco.func) == "pytest.mark.parametrize" and deco.args):
            continue
        names = ast.literal_eval(deco.args[0])
        single = len(names.split(",") if isinstance(names, str) else names) == 1
        ids = next((k.value for k in deco.keywords if k.arg == "ids"), None)
        if isinstance(ids, ast.List | ast.Tuple):
            found.update(str(ast.literal_eval(e)) for e in ids.elts)
            continue
        values = _literal_values(path, deco.args[1] if len(deco.args) > 1 else deco.keywords[0].value) or []
        for value in values:
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "pytest.param":
                found.update(k.value.value for k in value.keywords
                             if k.arg == "id" and isinstance(k.value, ast.Constant))
            elif single and isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(value.value)
    return found


def test_every_referenced_test_exists():
    """Every node id in KEY_TESTS names a test function that exists (and a parametrisation by its
    explicit id, when it names one): a renamed or deleted test fails here, not silently."""
    problems = []
    for key, node_ids in sorted(KEY_TESTS.items()):
        for node_id in node_ids:
            path, _, rest = node_id.partition("::")
            name, _, param = rest.partition("[")
            if not (REPO / path).is_file() or not path.startswith("tests/"):
                problems.append(f"{key}: {node_id}: no file {path}")
            elif name not in _test_functions(path):
                problems.append(f"{key}: {node_id}: {path} has no test {name}")
            elif param and param.removesuffix("]") not in _explicit_ids(path, _test_functions(path)[name]):
                problems.append(f"{key}: {node_id}: {name} has no parametrisation with the explicit id "
                                f"{param.removesuffix(']')!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("removed", ["actor.optimizer.type", "sft.eval_every"])
def test_keys_that_did_nothing_are_gone(removed):
    """Keys removed by the audit because nothing read them are refused like any unknown key."""
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"unknown config key '{re.escape(removed)}'"):
        load_run_config(None, [f"{removed}=1"])
