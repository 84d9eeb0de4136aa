"""A run's teacher (`teacher.*`, `algo.distill.kl_coef`): what the config refuses, naming the key;
the shared-tokenizer check naming both directories; and the teacher fleet as the launcher starts
it (real `tandem serve` processes under the local scheduler) or takes it from `teacher.servers`,
scoring through the scorer the run's controller gets."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.launch import LocalScheduler
from tandem.rl.config import load_run_config
from tandem.rl.scorers import check_scorers, start_scorers
from tests.inference.server_utils import ServerProcess
from tests.launch.procs import CHILD_ENV
from tests.rl.test_launch_keys import CORE, _get
from tests.rollout.conftest import run

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from tandem.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("teacher") / "tiny", preset="tiny", seed=5)


def _distill(model_dir, teacher_dir, *overrides: str) -> list[str]:
    return [f"actor.path={model_dir}", "algo.name=distill", f"teacher.path={teacher_dir}", *overrides]


@pytest.mark.parametrize(("overrides", "message"), [
    (["algo.name=distill"], r"algo.distill.kl_coef=1 \(algo.name='distill'\) needs a teacher: set teacher.path"),
    (["algo.distill.kl_coef=0.5"], r"algo.distill.kl_coef=0.5 needs a teacher: set teacher.path"),
    (["teacher.path={teacher}"], r"teacher.path is set but does nothing in this run: .*algo.distill.kl_coef > 0"),
    (["teacher.cpus=0"], r"teacher.cpus is set but does nothing in this run: it needs teacher.path"),
    (["algo.name=distill", "algo.distill.kl_coef=0", "teacher.path={teacher}"],
     r"algo.distill.kl_coef=0 with algo.name='distill' leaves nothing to learn from"),
    (["algo.name=distill", "teacher.path={teacher}", "teacher.backend=vllm:d1"],
     r"teacher.backend='vllm:d1': Tandem reads scores from tandem and sglang servers only.*use teacher.backend=tandem:d1"),
    (["algo.name=distill", "teacher.path={teacher}", "teacher.backend=sglang:d1"],
     r"teacher.servers is empty: Tandem does not start sglang servers"),
    (["algo.name=distill", "teacher.path={teacher}", "teacher.min_servers=2"],
     r"teacher.min_servers=2 is more than the 1 server\(s\) of teacher"),
    (["algo.name=distill", "teacher.path={teacher}/nowhere"], r"teacher.path: .*nowhere' does not exist"),
    (["algo.name=distill", "teacher.path={teacher}", "teacher.request_deadline_s=0"],
     r"teacher.request_deadline_s"),
])
def test_teacher_settings_are_refused_naming_the_key(overrides, message, model_dir, teacher_dir):
    keys = [o.format(teacher=teacher_dir) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, [f"actor.path={model_dir}", *keys])


def test_sft_refuses_a_teacher(model_dir, teacher_dir):
    with pytest.raises(ConfigError, match=r"teacher.path is set but `tandem sft` has no teacher"):
        load_run_config(None, [f"actor.path={model_dir}", f"teacher.path={teacher_dir}"], command="sft")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(model_dir, teacher_dir, tmp_path):
    """Same model, two token ids swapped in the teacher's tokenizer.json: refused before launch,
    naming both directories and one token whose id differs; the unchanged teacher passes."""
    other = tmp_path / "other-teacher"
    shutil.copytree(teacher_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    check_scorers(load_run_config(None, _distill(model_dir, teacher_dir)))
    cfg = load_run_config(None, _distill(model_dir, other))
    with pytest.raises(ConfigError) as err:
        check_scorers(cfg)
    text = str(err.value)
    assert f"teacher.path={str(other)!r}" in text and f"actor.path={str(model_dir)!r}" in text, text
    assert repr(first) in text or repr(second) in text, text
    assert "must share the actor's tokenizer" in text


def _episode(ids: list[int], generated: int) -> Trajectory:
    mask = [0] * (len(ids) - generated) + [1] * generated
    return Trajectory(input_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), versions=[-1] * len(ids))


def test_launched_teacher_servers_take_the_teacher_keys(tmp_path, model_dir, teacher_dir):
    """Catches `teacher.backend`, `cpus`, `server_args`, `api_key`, `min_servers`,
    `request_deadline_s` or `call_timeout_s` not reaching the teacher fleet: two `tandem serve` of
    teacher.path start pinned to the core with the extra options and refuse callers without the
    key; the scorer routes to both with the key and the configured deadlines, and scores."""
    cfg = load_run_config(None, _distill(model_dir, teacher_dir, "teacher.backend=tandem:d2", f"teacher.cpus={CORE}",
                                         "teacher.server_args=[--max-num-seqs, '3', --num-threads, '1']",
                                         "teacher.api_key=the-teachers-key", "teacher.min_servers=2",
                                         "teacher.request_deadline_s=42", "teacher.call_timeout_s=7"))
    with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10) as scheduler:
        (scorer,) = start_scorers(cfg, scheduler, None)  # no judge: the actor's tokenizer goes unused
        names = sorted(p.name for p in scheduler.processes)
        assert names == ["teacher-0", "teacher-1"], names
        assert {s.address for s in scorer.pool.snapshot()} == {h.url for h in scheduler.servers}
        for handle in scheduler.servers:
            assert os.sched_getaffinity(handle.pid) == {CORE}
            assert str(teacher_dir) in Path(f"/proc/{handle.pid}/cmdline").read_text().split("\0")
            status, info = _get(handle.url + "/get_server_info", "the-teachers-key")
            assert status == 200 and info["max_num_seqs"] == 3, info
            assert _get(handle.url + "/get_server_info")[0] == 401
        assert (scorer.client.config.deadline_s, scorer.client.config.call_timeout_s) == (42.0, 7.0)
        assert scorer.client.config.api_key == "the-teachers-key" and scorer.fleet.min_servers == 2
        trajectory = _episode([1, 2, 3, 4, 5, 6], 3)
        try:
            run(scorer.ascore([trajectory]))
        finally:
            scorer.close()
        assert trajectory.teacher_logprobs[:3] == [0.0] * 3 and all(lp < 0 for lp in trajectory.teacher_logprobs[3:])


def test_listed_teacher_servers_are_used_as_they_are(tmp_path, model_dir, teacher_dir):
    """`teacher.servers`: nothing is launched, the scorer routes to the listed server."""
    server = ServerProcess(teacher_dir, tmp_path)
    try:
        cfg = load_run_config(None, _distill(model_dir, teacher_dir, f"teacher.servers=[{server.url}]"))
        with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10) as scheduler:
            (scorer,) = start_scorers(cfg, scheduler, None)  # no judge: the actor's tokenizer goes unused
            assert scheduler.processes == []
            assert [s.address for s in scorer.pool.snapshot()] == [server.url]
            trajectory = _episode([7, 8, 9, 10], 2)
            try:
                run(scorer.ascore([trajectory]))
            finally:
                scorer.close()
            assert all(lp < 0 for lp in trajectory.teacher_logprobs[2:])
    finally:
        server.stop()
