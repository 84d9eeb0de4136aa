"""Item 3: weight updates from a trainer (`TrainEngine` on the device, float32, this process) to a
`tandem serve --device cuda` process on the same GPU, after real optimizer steps: over disk, then
twice over shared memory, which on CUDA carries each bucket as a CUDA IPC handle of a device
buffer the server copies from (`tandem.weights.shm.cuda_ipc_handle` / `open_cuda_ipc`; on the CPU
dry run, /dev/shm segments instead).

After each update the server must report the new version, pass the updater's verify, hold the
trainer's exact float32 tensors (the test's own checksums), serve greedy tokens equal to
`transformers` `generate` on the trainer's saved new weights (but at fp32 near-ties, reported),
and logprobs within 1e-4 of the trainer's recompute; and the served outputs must move (a server
left on its old weights fails).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines
from tandem.train import TrainEngine
from tandem.train.config import OptimizerConfig
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import WeightSyncError
from tandem.weights.updater import WeightUpdater
from tests.gpu.common import (
    compare_greedy,
    hf_greedy,
    hf_model,
    max_logprob_diff,
    recompute,
    start_device_server,
    wait_all,
)
from tests.inference.conftest import prompts
from tests.train.helpers import engine_config, full_params, make_batch, weighted_loss
from tests.weights.common import (
    expected_checksums,
    mapped_segments,
    served_checksums,
    served_greedy,
    version_of,
)

pytestmark = pytest.mark.timeout(480)

PROMPTS = prompts([6, 13, 9], seed=5)
NEW = 12
TOL = 1e-4
LR = 3e-3
UPDATES = ("disk", "shm", "shm")
DEADLINES = Deadlines(init_group_s=60, bucket_s=60, update_s=180, http_s=60)


def _check_serving(label, server, engine, model_dir_new, device) -> tuple[list, float, list]:
    """Served greedy + logprobs vs transformers on `model_dir_new` and the engine's recompute."""
    served = [served_greedy(server, p, NEW) for p in PROMPTS]
    hf = hf_model(model_dir_new, torch.float32, device)
    partings = []
    for prompt, (tokens, _, _) in zip(PROMPTS, served, strict=True):
        _, excusable, why = compare_greedy(hf, prompt, tokens, hf_greedy(hf, prompt, NEW, device), device)
        if why:
            partings.append((why, excusable))
    bad = [why for why, excusable in partings if not excusable]
    assert not bad, f"{label}: served greedy differs from transformers on the new weights: {bad}"
    diff = max_logprob_diff([lps for _, lps, _ in served], recompute(engine, PROMPTS, [t for t, _, _ in served]))
    assert diff <= TOL, f"{label}: served logprobs differ from the trainer's recompute by {diff:.3e} > {TOL}"
    return served, diff, partings


def test_updates_by_disk_and_shared_memory_reach_the_server(model_dir, device, tmp_path):
    versions_dir = tmp_path / "versions"
    with contextlib.ExitStack() as stack:
        server = start_device_server(model_dir, tmp_path, device, "float32", weights_dir=tmp_path)
        stack.callback(server.stop)  # the server starts while the trainer does
        engine = TrainEngine(engine_config(str(model_dir), device=str(device), optimizer=OptimizerConfig(
            lr=LR, weight_decay=0.01, gradient_clipping=1.0)))
        stack.callback(engine.close)
        batch = make_batch(engine.model.args.vocab_size, [5, 17, 3, 30])
        wait_all([server])
        fleet = HttpFleet([server.url], deadlines=DEADLINES)
        stack.callback(fleet.close)

        assert served_checksums(server) == expected_checksums(full_params(engine)), "initial weights differ"
        before, diff, partings = _check_serving("initial weights", server, engine, model_dir, device)
        figures = {"initial": (f"{diff:.2e}", len(partings))}
        for version, kind in enumerate(UPDATES, start=1):
            label = f"update {version} ({kind})"
            stats = engine.train_batch(batch, weighted_loss)
            assert stats["skipped"] == 0.0, (label, stats)
            meta = WeightUpdateMeta(type=kind, path=str(versions_dir), bucket_bytes=48 * 1024, deadlines=DEADLINES)
            with WeightUpdater(engine, fleet, meta, verify=True) as updater:
                try:
                    report = updater.update(version)
                except WeightSyncError as exc:
                    pytest.fail(f"{label}: the update failed: {exc}\nserver log:\n{server.log.read_text()[-4000:]}")
            assert report.verified, label
            assert version_of(server) == str(version), label
            tensors = full_params(engine)
            assert served_checksums(server) == expected_checksums(tensors), f"{label}: the server's weights differ"
            if kind == "shm" and device.type == "cuda":
                # CUDA IPC: the server copied from the trainer's device buffer; no host segment was used
                assert not mapped_segments(server.pid), (label, mapped_segments(server.pid))
            elif kind == "shm":  # the CPU dry run: served zero-copy from the trainer's /dev/shm segments
                assert mapped_segments(server.pid), label
            new_dir = engine.save_hf(tmp_path / f"hf-v{version}", tokenizer_dir=model_dir)
            after, diff, partings = _check_serving(label, server, engine, new_dir, device)
            assert {v for _, _, v in after} == {str(version)}, (label, after)
            moved = max(max(abs(a - b) for a, b in zip(new[1], old[1], strict=True))
                        for new, old in zip(after, before, strict=True))
            tokens_moved = any(new[0] != old[0] for new, old in zip(after, before, strict=True))
            assert moved > 10 * TOL or tokens_moved, f"{label}: the served outputs did not move: stale weights?"
            figures[label] = (f"{diff:.2e}", len(partings), "tokens moved" if tokens_moved else f"moved {moved:.3f}")
            print(f"\n[weight update {version} by {kind}, {device}] verified, {report.seconds:.3f} s for {report.bytes} "
                  f"bytes in {report.buckets} buckets; max "
                  f"|served logprob - trainer recompute| {diff:.2e}; greedy partings at near-ties {len(partings)}; "
                  f"{figures[label][2]}")
            before = after
        print(f"\n[weight updates, {device}] per state: (max |served logprob - trainer recompute|, greedy "
              f"partings from transformers at near-ties, how the outputs moved): {figures}")
    assert server.proc.returncode == 0, server.log.read_text()
