"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright.

- A real `tandem train` run with the page open while it goes: a launched server SIGKILLed mid-run
  shows as evicted in the fleet table within the detection bound; after the run, the trajectory
  view shows a sampled completion and its reward exactly as the run's own trajectory dump holds
  them (`rollout.dump_dir`, an independent path), and the trainer logprobs it shows per token are
  transformers' on the same weights.
- A finished run of 1,000 steps and 100,000 recorded trajectories loads in under 2 s.

Screenshots of each view go to the test's directory, and to $TANDEM_SCREENSHOTS when it is set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tandem.dashboard.record import DIRECTORY
from tests.dashboard.runs import TANDEM, Dashboard, write_run
from tests.launch.procs import cmdline, descendants, listening_sockets, wait_gone
from tests.rl.common import rl_rows, run_dir, write_config

ROOT = Path(__file__).resolve().parents[2]
HEALTH = {"interval_s": 1.0, "timeout_s": 1.0, "failure_threshold": 2}
FLEET_INTERVAL_S = 0.5
REWARD = """
def score(prompt_text, completion_text, prompt_ids, completion_ids, **item_fields):
    return sum(completion_ids) % 7 / 7  # varied, and computable from the tokens alone
"""


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        failed = ROOT / ".browser.failed"
        pytest.skip("chromium is not installed (" + (failed.read_text().strip() if failed.exists()
                                                      else "run `make browser-deps`") + ")")
    return path


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


def shoot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if out := os.environ.get("TANDEM_SCREENSHOTS"):
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


def test_a_live_run_in_the_browser(tmp_path, model_dir, browser):
    dump = tmp_path / "dump"
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = write_config(tmp_path, model_dir, train={"total_steps": 8},
                       rollout={"dump_dir": str(dump), "health": HEALTH, "reward": f"{tmp_path / 'reward.py'}:score"},
                       dashboard={"fleet_interval_s": FLEET_INTERVAL_S, "trainer_logprobs": True})
    proc = subprocess.Popen([TANDEM, "train", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    run = run_dir(tmp_path)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        deadline = time.monotonic() + 300
        while not (run / DIRECTORY / "fleet.json").is_file():  # bounded: the run's start
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run recorded no fleet within 300 s"
            time.sleep(0.2)
        with Dashboard(run) as dash:
            page.goto(dash.url)
            page.wait_for_selector("body[data-loaded='1']")
            assert page.inner_text("#run-state") == "running"
            page.click("nav button[data-view=fleet]")
            page.wait_for_selector("#fleet-table tbody tr .state-healthy")
            while len(rl_rows(tmp_path)) < 2:  # bounded by the deadline above
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the run made no progress"
                time.sleep(0.2)
            tree = descendants(proc.pid)
            fleet_ports = {int(s["address"].rsplit(":", 1)[1])
                           for s in json.loads((run / DIRECTORY / "fleet.json").read_text())["servers"]}
            victim, port = next((pid, port) for pid in sorted(tree) if "-m tandem.cli serve" in cmdline(pid)
                                for p, _, port in listening_sockets({pid}) if p == pid and port in fleet_ports)
            address = f"http://127.0.0.1:{port}"
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            row = f"#fleet-table tbody tr[data-address='{address}'] .state-evicted"
            page.wait_for_selector(row, timeout=60_000)
            seen = time.monotonic() - killed
            # Detection (probes: interval x threshold + 1 s; the launcher's watch is faster), then
            # the recorder's next poll and the page's next refresh (server-sent events, 0.5 s polls).
            bound = HEALTH["interval_s"] * HEALTH["failure_threshold"] + 1 + FLEET_INTERVAL_S + 1.5
            print(f"the page showed the kill after {seen:.2f} s (bound {bound:.1f} s)")
            assert seen < bound, f"the page showed the kill after {seen:.1f} s (bound {bound:.1f} s)"
            shoot(page, tmp_path, "fleet")
            _, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, err[-3000:]
            assert not wait_gone(tree), "processes left behind"

            page.goto(dash.base + "/")
            page.wait_for_selector("body[data-loaded='1']")
            page.wait_for_function("document.querySelectorAll('#curves .chart').length >= 3")
            assert page.inner_text("#run-state") == "finished"
            shoot(page, tmp_path, "overview")
            page.click("nav button[data-view=trajectories]")
            page.fill("input[name=step]", "1")
            page.fill("input[name=min_reward]", "0.1")
            page.click("#filters button")
            page.wait_for_function("document.querySelector('#traj-count').textContent !== '' && "
                                   "document.querySelectorAll('#traj-list tbody tr').length > 0 && "
                                   "[...document.querySelectorAll('#traj-list tbody tr')].every(r => r.dataset.step === '1')")
            rewards = [float(x) for x in page.eval_on_selector_all("#traj-list tbody tr td:nth-child(3)",
                                                                   "els => els.map(e => e.textContent)")]
            assert rewards and min(rewards) >= 0.1
            page.click("#traj-list tbody tr")
            page.wait_for_selector("#traj-detail .facts")
            shoot(page, tmp_path, "trajectory")
            shown_completion = page.text_content("#traj-detail pre.completion")
            shown_tokens = page.eval_on_selector_all("#traj-detail .tokens span", "els => els.map(e => e.textContent)")
            shown_reward = float(page.inner_text("#traj-detail .reward"))
            titles = page.eval_on_selector_all("#traj-detail .call span[title]", "els => els.map(e => e.title)")
    finally:
        page.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)

    # The completion and reward the page shows are the run's: the trajectory dump (written by the
    # rollout executor, not the recorder) holds a trajectory with that completion and reward.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dumped = [json.loads(line) for f in sorted(dump.glob("*.jsonl")) for line in f.read_text().splitlines()]
    matches = [t for t in dumped if tokenizer.batch_decode([[x] for x in t["input_ids"]]) == shown_tokens]
    assert matches, f"no dumped trajectory has the tokens the page shows: {shown_tokens!r}"
    completion_ids = [x for x, m in zip(matches[0]["input_ids"], matches[0]["loss_mask"], strict=True) if m]
    assert tokenizer.decode(completion_ids) == shown_completion
    assert all(t["reward"] == pytest.approx(shown_reward, abs=1e-3) for t in matches)
    assert shown_reward == pytest.approx(sum(completion_ids) % 7 / 7, abs=1e-3)  # the reward, by hand

    # The per-token trainer logprobs the page shows for step 1 (trained from version 0, the initial
    # weights) are transformers' logprobs of the same tokens under the initial model.
    assert titles and all("trainer logprob" in t for t in titles), titles[:3]
    shown = [float(t.split("trainer logprob ")[1].split(",")[0]) for t in titles]
    oracle = _transformers_logprobs(model_dir, matches[0])
    assert len(shown) == len(oracle)
    assert max(abs(a - b) for a, b in zip(shown, oracle, strict=True)) < 1e-4


def _transformers_logprobs(model_dir: Path, traj: dict) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([traj["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[t - 1, traj["input_ids"][t]]) for t in range(1, len(ids[0])) if traj["loss_mask"][t]]


def test_a_finished_run_of_1000_steps_and_100000_trajectories_loads_in_under_2_seconds(tmp_path, browser):
    began = time.monotonic()
    run = write_run(tmp_path / "e2e" / "big", steps=1000, per_step=100, servers=64, key="k", completion_tokens=12)
    written = time.monotonic() - began
    with Dashboard(run) as dash:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            start = time.monotonic()
            page.goto(dash.url)
            page.wait_for_selector("body[data-loaded='1']")
            page.wait_for_function("document.querySelectorAll('#curves .chart').length >= 5 && "
                                   "document.querySelectorAll('#timeline rect').length >= 3000")
            loaded = time.monotonic() - start
            shoot(page, tmp_path, "overview-1000-steps")
            page.click("nav button[data-view=trajectories]")
            page.wait_for_function("document.querySelector('#traj-count').textContent === '100000 trajectories'")
            start = time.monotonic()
            page.fill("input[name=min_reward]", "1")
            page.fill("input[name=staleness]", "2")
            page.click("#filters button")
            page.wait_for_function("!document.querySelector('#traj-count').textContent.startsWith('100000')")
            filtered = time.monotonic() - start
            count = int(page.inner_text("#traj-count").split()[0])
            page.click("#traj-list tbody tr")
            page.wait_for_selector("#traj-detail .facts")
            shoot(page, tmp_path, "trajectory-1000-steps")
        finally:
            page.close()
    print(f"1,000 steps: written in {written:.1f} s, page loaded in {loaded:.2f} s, filtered in {filtered:.2f} s")
    assert loaded < 2.0, f"the 1,000-step page took {loaded:.2f} s to load"
    assert 0 < count < 100_000 and filtered < 2.0


def test_an_agent_trajectory_shows_each_call_of_its_chain(tmp_path, browser):
    """A trajectory of two model calls with a tool's output between them (loss mask 0 1 1 0 0 1 1 1):
    the page shows the prompt, call 1, the context, call 2, each call's tokens coloured apart."""
    from tandem.dashboard.record import DashboardConfig, RunRecorder
    from tandem.data.trajectory import Trajectory

    run = tmp_path / "e2e" / "agent"
    words = {1: "Q", 2: "?", 10: " call", 11: "(x)", 20: " tool", 21: " says", 30: " so", 31: " the", 32: " end"}
    rec = RunRecorder(run, DashboardConfig(trajectories_per_step=1),
                      pieces=lambda ids: [words[i] for i in ids], text=lambda ids: "".join(words[i] for i in ids))
    ids = [1, 2, 10, 11, 20, 21, 30, 31, 32]
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 1]
    rec.record_step(1, 0, [Trajectory(ids, mask, [0.0, 0, -0.5, -0.4, 0, 0, -0.3, -0.2, -0.1],
                                      [-1, -1, 0, 0, -1, -1, 0, 0, 0], reward=1.0, num_turns=2)], [0])
    rec.close()
    with Dashboard(run) as dash:
        page = browser.new_page()
        try:
            page.goto(dash.url + "#trajectories")
            page.wait_for_selector("#traj-list tbody tr")
            page.click("#traj-list tbody tr")
            page.wait_for_selector("#traj-detail .facts")
            blocks = page.eval_on_selector_all("#traj-detail > div.call, #traj-detail > div.context",
                                               "els => els.map(e => [e.className, e.querySelector('.muted').textContent,"
                                               " e.querySelector('.tokens').textContent])")
        finally:
            page.close()
    assert blocks == [["context", "prompt", "Q?"], ["call", "call 1", " call(x)"],
                      ["context", "context (tool output, next turn)", " tool says"], ["call", "call 2", " so the end"]]
