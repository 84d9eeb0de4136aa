"""Verifiable tasks for RL and SFT: generators, exact rewards, a GSM8K-format loader, an agentic
task with a calculator tool, programming problems checked in the sandbox, chat encoding.

    from tandem.data.tasks import get_task
    task = get_task("arithmetic", difficulty="add2")
    items = task.generate(256, seed=0, split="train")
    reward_fn = task.reward_fn()          # for RLVRWorkflow / the reward runner

See docs/tasks.md.
"""

from tandem.data.tasks.arithmetic import ArithmeticTask
from tandem.data.tasks.base import (
    Task,
    TaskDataError,
    TaskError,
    available_tasks,
    get_task,
    register_task,
    split_of,
)
from tandem.data.tasks.calculator import CALCULATOR_TOOL, CalculatorTask, evaluate_expression
from tandem.data.tasks.chat import (
    TemplateError,
    encode_completion,
    encode_conversation,
    encode_prompt,
    encode_sft_pair,
    sft_example,
    with_input_ids,
)
from tandem.data.tasks.code import CodeTask, extract_code
from tandem.data.tasks.code_files import load_code_file
from tandem.data.tasks.countdown import CountdownTask
from tandem.data.tasks.extract import extract_integer
from tandem.data.tasks.gsm8k import GSM8KTask, load_gsm8k_file
from tandem.data.tasks.rewards import (
    TaskReward,
    arithmetic_reward,
    calculator_reward,
    countdown_reward,
    gsm8k_reward,
    task_reward,
)

__all__ = [
    "CALCULATOR_TOOL",
    "ArithmeticTask",
    "CalculatorTask",
    "CodeTask",
    "CountdownTask",
    "GSM8KTask",
    "Task",
    "TaskDataError",
    "TaskError",
    "TaskReward",
    "TemplateError",
    "arithmetic_reward",
    "available_tasks",
    "calculator_reward",
    "countdown_reward",
    "encode_completion",
    "encode_conversation",
    "encode_prompt",
    "encode_sft_pair",
    "evaluate_expression",
    "extract_code",
    "extract_integer",
    "get_task",
    "gsm8k_reward",
    "load_code_file",
    "load_gsm8k_file",
    "register_task",
    "sft_example",
    "split_of",
    "task_reward",
    "with_input_ids",
]
