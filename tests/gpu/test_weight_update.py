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

Then a `--dtype bfloat16` server takes updates from the same float32 trainer (shared memory with
bf16 on the wire, then float32 cast by the server; disk): it must hold the trainer's tensors cast
to bfloat16 exactly, and its logprobs must be within 0.1 of a bf16 recompute.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines
from tandem.models import load_model
from tandem.train import TrainEngine
from tandem.train.config import OptimizerConfig
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.verify import tensor_checksum
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
    load_into,
    mapped_segments,
    served_checksums,
    served_greedy,
    verified_update,
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


def _trainer_beside_server(stack: contextlib.ExitStack, model_dir, tmp_path, device, dtype_name: str):
    """A `tandem serve --dtype dtype_name` on `device` (started while the trainer builds), a
    TrainEngine of the same checkpoint, a training batch and an HttpFleet to the server, each
    closed by `stack`. -> (server, engine, batch, fleet)"""
    server = start_device_server(model_dir, tmp_path, device, dtype_name, weights_dir=tmp_path)
    stack.callback(server.stop)
    engine = TrainEngine(engine_config(str(model_dir), device=str(device), optimizer=OptimizerConfig(
        lr=LR, weight_decay=0.01, gradient_clipping=1.0)))
    stack.callback(engine.close)
    batch = make_batch(engine.model.args.vocab_size, [5, 17, 3, 30])
    wait_all([server])
    fleet = HttpFleet([server.url], deadlines=DEADLINES)
    stack.callback(fleet.close)
    return server, engine, batch, fleet


def test_updates_by_disk_and_shared_memory_reach_the_server(model_dir, device, tmp_path):
    versions_dir = tmp_path / "versions"
    with contextlib.ExitStack() as stack:
        server, engine, batch, fleet = _trainer_beside_server(stack, model_dir, tmp_path, device, "float32")

        assert served_checksums(server) == expected_checksums(full_params(engine)), "initial weights differ"
        before, diff, partings = _check_serving("initial weights", server, engine, model_dir, device)
        figures = {"initial": (f"{diff:.2e}", len(partings))}
        for version, kind in enumerate(UPDATES, start=1):
            label = f"update {version} ({kind})"
            stats = engine.train_batch(batch, weighted_loss)
            assert stats["skipped"] == 0.0, (label, stats)
            meta = WeightUpdateMeta(type=kind, path=str(versions_dir), bucket_bytes=48 * 1024, deadlines=DEADLINES)
            report = verified_update(engine, fleet, meta, version, label, server)
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


BF16_TOL = 0.1  # three bf16 ulps of logits below 8 (tests/weights/test_bf16_serving.py: 0.029 measured on CPU)
# (transport, dtype on the wire: None = the trainer's float32, cast by the server)
BF16_UPDATES = (("shm", torch.bfloat16), ("shm", None), ("disk", None))


@torch.no_grad()
def _bf16_recompute(model_dir, tensors: dict[str, torch.Tensor], served, device: torch.device) -> list[torch.Tensor]:
    """The trainer's bf16 view of the served outputs: the native model in bfloat16 on the device
    holding the trainer's float32 weights cast to bfloat16, one packed forward over every prompt
    and its output -> per prompt, the float32 logits that predict each served token."""
    model = load_into(load_model(model_dir, dtype=torch.bfloat16, device=device), tensors)
    seqs = [prompt + tokens for prompt, (tokens, _, _) in zip(PROMPTS, served, strict=True)]
    ends = list(itertools.accumulate(len(s) for s in seqs))
    logits = model(torch.tensor([t for s in seqs for t in s], device=device),
                   torch.tensor([0, *ends], dtype=torch.int32, device=device)).float().cpu()
    return [logits[end - len(s) + len(p) - 1: end - 1] for p, s, end in zip(PROMPTS, seqs, ends, strict=True)]


def test_bf16_server_takes_updates_from_an_fp32_trainer(model_dir, device, tmp_path):
    """`tandem serve --dtype bfloat16` on the device, updated from the float32 trainer by shared
    memory (bf16 on the wire, then float32 cast by the server) and by disk: it must hold exactly
    the trainer's tensors cast to bfloat16 (its checksums), and serve logprobs within BF16_TOL of
    a bf16 recompute of the same tokens (near-ties make bf16 greedy tokens not comparable: the
    count of served tokens that are not the recompute's argmax is printed)."""
    with contextlib.ExitStack() as stack:
        server, engine, batch, fleet = _trainer_beside_server(stack, model_dir, tmp_path, device, "bfloat16")
        before = [served_greedy(server, p, NEW) for p in PROMPTS]
        for version, (kind, wire) in enumerate(BF16_UPDATES, start=1):
            label = f"bf16 server, update {version} ({kind}, {'bfloat16' if wire else 'float32'} on the wire)"
            engine.train_batch(batch, weighted_loss)
            meta = WeightUpdateMeta(type=kind, path=str(tmp_path / "versions"), bucket_bytes=48 * 1024,
                                    deadlines=DEADLINES)
            report = verified_update(engine, fleet, meta, version, label, server, dtype=wire)
            tensors = full_params(engine)
            sums = server.ok("/get_weights_checksum", {})
            assert sums["dtype"] == "bfloat16", (label, sums["dtype"])
            want = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in tensors.items()}
            assert sums["checksums"] == want, f"{label}: the server does not hold the trainer's weights in bf16"
            after = [served_greedy(server, p, NEW) for p in PROMPTS]
            logits = _bf16_recompute(model_dir, tensors, after, device)
            diff = max(float((torch.tensor(lps) - torch.log_softmax(lg, -1)[torch.arange(NEW), torch.tensor(toks)])
                             .abs().max()) for (toks, lps, _), lg in zip(after, logits, strict=True))
            off_argmax = sum(int((lg.argmax(-1) != torch.tensor(toks)).sum())
                             for (toks, _, _), lg in zip(after, logits, strict=True))
            moved = max(max(abs(a - b) for a, b in zip(new[1], old[1], strict=True))
                        for new, old in zip(after, before, strict=True))
            tokens_moved = any(new[0] != old[0] for new, old in zip(after, before, strict=True))
            print(f"\n[{label}, {device}] verified, {report.seconds:.3f} s; max |served logprob - bf16 recompute| "
                  f"{diff:.3e} (tol {BF16_TOL}); served tokens off the recompute's argmax {off_argmax}/"
                  f"{NEW * len(PROMPTS)}; {'tokens moved' if tokens_moved else f'moved {moved:.3f}'}")
            assert diff <= BF16_TOL, label
            assert moved > BF16_TOL or tokens_moved, f"{label}: the served outputs did not move: stale weights?"
            before = after
    assert server.proc.returncode == 0, server.log.read_text()
