"""An LLM judge as the run's reward: a fleet of generation servers holding a judge model that reads
each sample's answer and writes a verdict, which a parser turns into the reward.

With `judge.path`, the executor awaits `JudgeScorer.ascore` on every episode a workflow returned.
For each trajectory the judge's user message is `judge.template` filled with the policy's prompt
text (`{prompt}`), its completion decoded (`{completion}`) and the item's fields (`{answer}`, ...);
the judge model answers greedily (its own chat template and tokenizer: it reads text), and
`judge.parser` reads the verdict: `yes_no` (first word yes -> 1.0, no -> 0.0), `number` (the first
number in it), or a user function `module:function(text) -> float`. The trajectory keeps
`info["judge_text"]`, `info["judge_score"]` and `info["task_reward"]`; its reward becomes the score
(`judge.mode=replace`) or the workflow's reward plus it (`add`). A verdict the parser cannot read is
a failed reward (`RewardError`): the episode fails like one whose reward function raised, the run
goes on. The fleet is a `ScoringFleet` (probes, eviction, retries). See docs/rewards.md, "Judges"."""

from __future__ import annotations

import asyncio
import math
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.config.fields import config_field as _f
from tandem.data.tasks.chat import encode_prompt
from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.fleet.generation import GenerationParams
from tandem.rollout.errors import RewardError
from tandem.rollout.reward_model import MODES
from tandem.rollout.scoring import ScoringFleet, ScoringFleetConfig
from tandem.rollout.types import ModelRequest
from tandem.user_code import import_user_object

DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {answer}\nAnswer to judge: {completion}\n"
                    "Is the answer to judge correct? Reply yes or no.")
PARSERS = ("yes_no", "number")
POLICY_FIELDS = ("prompt", "completion")  # what the template gets from the trajectory; the rest from the item


@dataclass
class JudgeConfig(ScoringFleetConfig):
    """The `judge` section: a generative judge whose parsed verdict is the episode's reward."""

    SECTION: ClassVar[str] = "judge"

    path: str = _f("", "HF directory of the judge (a causal LM; its own tokenizer: it reads text). Empty: no judge.")
    template: str = _f(DEFAULT_TEMPLATE, "The judge's user message: {prompt} (the policy's prompt), {completion} "
                                         "(its answer) and any field of the item, e.g. {answer}.")
    parser: str = _f("yes_no", "How the verdict becomes the reward: yes_no (first word yes: 1.0, no: 0.0), number "
                               "(the first number in it), or 'module:function' (text -> float; raise to refuse).")
    max_new_tokens: int = _f(16, "Most tokens of a verdict (greedy).", min=1)
    mode: str = _f("replace", "replace: the reward is the parsed verdict (the task's reward is kept in info); add: "
                              "the workflow's reward plus it.", choices=MODES)

    def check(self, prefix: str) -> None:
        super().check(prefix)
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None]
        except ValueError as exc:
            raise ConfigError(f"{prefix}template: {exc} (write a literal brace as {{{{ or }}}})") from None
        bad = [f for f in fields if not f.isidentifier()]
        if bad:
            raise ConfigError(f"{prefix}template: {{{bad[0]}}} is not a field name; use {{prompt}}, {{completion}} or "
                              "an item field such as {answer}")
        if "completion" not in fields:
            raise ConfigError(f"{prefix}template has no {{completion}}: the judge would never see the answer it judges")


def parse_yes_no(text: str) -> float:
    """1.0 for a verdict whose first word is yes, 0.0 for no (any case, trailing punctuation)."""
    words = text.strip().split()
    word = words[0].strip(".,:;!\"'").lower() if words else ""
    if word in ("yes", "no"):
        return 1.0 if word == "yes" else 0.0
    raise ValueError("the first word is neither yes nor no")


def parse_number(text: str) -> float:
    """The first number in the verdict (e.g. 'Score: 7/10' -> 7.0)."""
    found = re.search(r"[-+]?\d+(?:\.\d+)?", text)
    if found is None:
        raise ValueError("it holds no number")
    return float(found.group())


def verdict_parser(spec: str) -> Callable[[str], float]:
    if spec == "yes_no":
        return parse_yes_no
    if spec == "number":
        return parse_number
    fn = import_user_object(spec)
    if not callable(fn):
        raise ConfigError(f"judge.parser={spec!r} is not a function")
    return fn  # type: ignore[return-value]


class JudgeScorer(ScoringFleet):
    """Sets each trajectory's reward from the judge fleet's parsed verdict (the executor's episode
    scorer). `policy_tokenizer` decodes the policy's tokens; `judge_tokenizer` renders the judge's
    chat template and decodes its verdict."""

    def __init__(self, *args: Any, config: JudgeConfig, policy_tokenizer: Any, judge_tokenizer: Any, **kwargs: Any):
        super().__init__(*args, config, **kwargs)
        self.config = config
        self.parse = verdict_parser(config.parser)
        self.policy_tokenizer, self.judge_tokenizer = policy_tokenizer, judge_tokenizer
        self.unparsed = 0  # verdicts the parser refused

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "judge/unparsed_total": float(self.unparsed)}

    async def ascore(self, trajectories: list[Trajectory], item: Mapping[str, Any] | None = None) -> None:
        """The judge's verdict on each trajectory, the calls concurrent; raises `RewardError` (the
        episode fails) for a verdict the parser refuses or a score that is not finite."""
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._judge(t, item or {})) for t in trajectories]
        for t, task in zip(trajectories, tasks, strict=True):
            text, score = task.result()
            t.info["task_reward"], t.info["judge_text"], t.info["judge_score"] = t.reward, text, score
            t.reward = score if self.config.mode == "replace" else t.reward + score
        self.scored += len(trajectories)

    async def _judge(self, trajectory: Trajectory, item: Mapping[str, Any]) -> tuple[str, float]:
        ids = self.judge_ids(trajectory, item)
        params = GenerationParams(max_new_tokens=self.config.max_new_tokens, temperature=0.0)
        response = await self.client.agenerate(ModelRequest(ids, params))
        text = self.judge_tokenizer.decode(response.output_ids, skip_special_tokens=True)
        try:
            score = float(self.parse(text))
        except Exception as exc:  # the user's parser may raise anything: the reward failed
            self.unparsed += 1
            raise RewardError(f"the judge's verdict {text[:200]!r} cannot be read by judge.parser="
                              f"{self.config.parser!r}: {exc}") from None
        if not math.isfinite(score):
            raise RewardError(f"the judge's verdict {text[:200]!r} parsed to {score}: not a finite number")
        return text, score

    def judge_ids(self, trajectory: Trajectory, item: Mapping[str, Any]) -> list[int]:
        """The judge's prompt ids: `judge.template` filled and rendered by the judge's chat template."""
        start = next((i for i, m in enumerate(trajectory.loss_mask) if m), len(trajectory.input_ids))
        decode = self.policy_tokenizer.decode
        fields = {**item, "completion": decode(trajectory.input_ids[start:], skip_special_tokens=True)}
        if not isinstance(item.get("prompt"), str):
            fields["prompt"] = decode(trajectory.input_ids[:start], skip_special_tokens=True)
        try:
            message = self.config.template.format_map(fields)
        except KeyError as exc:
            raise RewardError(f"judge.template names {{{exc.args[0]}}}, which the item lacks (it has "
                              f"{sorted(k for k in item if isinstance(k, str))})") from None
        return encode_prompt({"prompt": message}, self.judge_tokenizer)
