"""bf16 serving updated from an fp32 trainer (issue 27, item 6): a real `tandem serve --dtype
bfloat16` takes verified updates from a real float32 `TrainEngine` after real optimizer steps,
by every transport and with the cast on either side: the server casting float32 tensors as it
stages them (disk; distributed and shm with float32 on the wire, which is what `tandem train`
sends from an fp32 trainer) and the trainer casting before it sends (distributed and shm with
`dtype=torch.bfloat16`, the shm one served zero-copy from the trainer's segments).

Before the first update and after each one, the server must report bfloat16 and hold exactly
the trainer's weights rounded to bfloat16 (verify passed, and the server's checksums equal the
test's own hashes of that cast), and its greedy tokens and logprobs must agree with the
trainer's bf16 recompute: the native model (`tandem.models`, the trainer's code) loaded in
bfloat16 with the trainer's float32 weights cast to bfloat16, scoring each prompt and its served
output in one packed forward, as the trainer scores a rollout. Every served token must be that
recompute's greedy choice after the served prefix (so, step by step, the recompute decodes the
same tokens) and its logprob must agree within TOL. Each update must also move the served
outputs (tokens, or a logprob by more than TOL), so a server still on its old weights fails.

Bugs caught (each seen failing the test with the product deliberately broken): a verify that
hashes the tensors in the dtype they travel in rather than the server's (the disk update fails
verify); a server that adopts staged tensors of another dtype without the cast (the
distributed float32 update fails verify); a server that acknowledges an update but keeps
serving stale weights (verify fails; with verify and the checksums left out, the first greedy
token differs); a server that ignores `--dtype` and serves float32 (its reported dtype; left
unchecked, the bf16 shm update is not served zero-copy). Tokens and logprobs alone do not
catch the last one: a float32 server's lie within TOL of the bf16 recompute too.

Tolerance: TOL = 0.0625 on each logprob, two bf16 ulps of the logits. Every logit here stays
below 8 in magnitude (asserted), where bfloat16's 8 significant bits leave a spacing (ulp) of
2**-5 = 0.03125. Server and recompute run the same bf16 network through different kernels
(paged attention and single-token decode steps vs. one dense causal forward), so their sums
are accumulated in different orders and a logit may round to the neighbouring bf16 value. A
logprob is the chosen logit minus the log-sum-exp of all of them (taken in float32 on both
sides, which moves by at most the largest logit's shift): one ulp each, two in all. Measured:
at most 0.029, one ulp; the same recompute in float32 is up to ~0.055 away from the bf16 one.

Greedy tokens are compared exactly, which is sound only without near-ties: with each logit
within one ulp on both sides, two tokens can swap places only where the recompute's top two
logits lie within two ulps (TOL) of each other. PROMPTS were chosen (out of 300 random ones) so
that every step of every version has a wider margin (the smallest is 0.19, six ulps), and the
test asserts it before comparing a token: failing there means choosing prompts again, not a
serving bug. This random tiny model has a near-tie within six steps at most prompts.
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
from tests.inference.conftest import make_model_dir
from tests.train.helpers import engine_config, full_params, make_batch, weighted_loss
from tests.weights.common import load_into, mapped_segments, served_greedy, start_server, verified_update

pytestmark = pytest.mark.slow

TOL = 0.0625  # two bf16 ulps of logits below 8 in magnitude (module docstring)
LOGIT_BOUND = 8.0
NEW = 6
PROMPTS = [[490, 217, 342, 396, 402], [445, 396, 487, 328], [288, 323, 72, 396, 436, 197]]
BATCH = [5, 17, 3, 30]  # sequence lengths of the training batch
LR = 3e-3  # every update moves the served outputs by more than TOL (logprobs by 0.10 at the least)
# (transport, dtype on the wire: None = the trainer's float32, cast by the server). The order
# walks the server through each change of where its parameters live: its own memory (disk), the
# distributed staging buffers it adopts (bf16), copies with a cast into those (fp32), zero-copy
# shared-memory segments (bf16), and a cast out of them into memory of its own again (fp32).
UPDATES = (("disk", None), ("distributed", torch.bfloat16), ("distributed", None), ("shm", torch.bfloat16),
           ("shm", None))
DEADLINES = Deadlines(init_group_s=30, bucket_s=30, update_s=120, http_s=30)


@torch.no_grad()
def _recompute(model_dir, tensors: dict[str, torch.Tensor], served) -> list[torch.Tensor]:
    """The trainer's bf16 recompute of what the server generated: the native model in bfloat16
    holding the trainer's float32 weights cast to bfloat16, one packed forward over every prompt
    and its served output (as the trainer scores a rollout) -> per prompt, the float32 logits
    that predict each served token."""
    model = load_into(load_model(model_dir, dtype=torch.bfloat16), tensors)
    seqs = [prompt + tokens for prompt, (tokens, _, _) in zip(PROMPTS, served, strict=True)]
    ends = list(itertools.accumulate(len(s) for s in seqs))
    logits = model(torch.tensor([t for s in seqs for t in s]), torch.tensor([0, *ends], dtype=torch.int32)).float()
    return [logits[end - len(s) + len(prompt) - 1: end - 1] for prompt, s, end in zip(PROMPTS, seqs, ends, strict=True)]


def _check(label: str, served, recomputed: list[torch.Tensor]) -> tuple[float, float]:
    """Served (tokens, logprobs, version) vs. the recompute: every served token is the
    recompute's greedy choice after the served prefix (so, step by step, the recompute decodes
    the same tokens), and its logprob agrees within TOL; -> (the largest |logprob difference|,
    the smallest top-two margin)."""
    worst, narrowest = 0.0, float("inf")
    for prompt, (tokens, logprobs, _), logits in zip(PROMPTS, served, recomputed, strict=True):
        assert len(tokens) == len(logprobs) == len(logits) == NEW, (label, prompt, tokens)
        assert float(logits.abs().max()) < LOGIT_BOUND, (label, prompt, float(logits.abs().max()))
        mine = torch.log_softmax(logits, -1)
        for k, (token, logprob, row) in enumerate(zip(tokens, logprobs, logits, strict=True)):
            top2 = torch.topk(row, 2).values
            margin = float(top2[0] - top2[1])
            narrowest = min(narrowest, margin)
            assert margin > TOL, (f"{label}: prompt {prompt} step {k} is a near-tie in the bf16 recompute (margin "
                                  f"{margin}); choose other PROMPTS")
            choice = int(row.argmax())
            assert token == choice, (f"{label}: prompt {prompt} step {k}: served token {token}, the recompute's "
                                     f"greedy choice {choice}", tokens)
            worst = max(worst, abs(logprob - float(mine[k, token])))
    assert worst <= TOL, (f"{label}: served logprobs differ from the trainer's bf16 recompute by {worst:.4f} "
                          f"> {TOL}", served)
    return worst, narrowest


def _assert_holds(label: str, server, tensors: dict[str, torch.Tensor]) -> None:
    """The server serves bfloat16 and holds exactly `tensors` rounded to it, by the test's own
    hashes (the logprob tolerance alone could not tell a float32 server from a bf16 one)."""
    sums = server.ok("/get_weights_checksum", {})
    assert sums["dtype"] == "bfloat16", (label, sums["dtype"])
    want = {name: tensor_checksum(t.to(torch.bfloat16)) for name, t in tensors.items()}
    differ = sorted(n for n in want.keys() | sums["checksums"].keys() if want.get(n) != sums["checksums"].get(n))
    assert not differ, f"{label}: {len(differ)} tensor(s) differ from the trainer's, cast to bfloat16: {differ[:3]}"


def test_bf16_server_takes_verified_updates_from_fp32_trainer(tmp_path):
    model_dir = make_model_dir(tmp_path / "models", "qwen3", seed=0)
    with contextlib.ExitStack() as stack:
        server = start_server(model_dir, tmp_path, tmp_path, "--dtype", "bfloat16", wait=False)
        stack.callback(server.stop)  # the server starts while the trainer does
        engine = TrainEngine(engine_config(str(model_dir), optimizer=OptimizerConfig(
            lr=LR, weight_decay=0.01, gradient_clipping=1.0)))
        stack.callback(engine.close)
        assert engine.param_dtype == torch.float32
        batch = make_batch(engine.model.args.vocab_size, BATCH)
        initial = full_params(engine)
        server.wait_ready()
        fleet = HttpFleet([server.url], deadlines=DEADLINES)
        stack.callback(fleet.close)

        _assert_holds("initial weights", server, initial)
        before = [served_greedy(server, prompt, NEW) for prompt in PROMPTS]
        moves: dict[str, object] = {}
        worst = {"initial weights": _check("initial weights", before, _recompute(model_dir, initial, before))}
        for version, (kind, wire) in enumerate(UPDATES, start=1):
            label = f"{kind}, {'bfloat16' if wire else 'float32'} on the wire"
            engine.train_batch(batch, weighted_loss)
            meta = WeightUpdateMeta(type=kind, path=str(tmp_path / "versions"), bucket_bytes=48 * 1024,
                                    deadlines=DEADLINES)
            verified_update(engine, fleet, meta, version, label, server, dtype=wire)
            tensors = full_params(engine)
            _assert_holds(label, server, tensors)

            if kind == "shm" and wire is not None:  # served from the trainer's segments, in place
                assert mapped_segments(server.pid), label

            after = [served_greedy(server, prompt, NEW) for prompt in PROMPTS]
            assert {v for _, _, v in after} == {str(version)}, (label, after)
            worst[label] = _check(label, after, _recompute(model_dir, tensors, after))
            moved = max(max(abs(a - b) for a, b in zip(new[1], old[1], strict=True))
                        for new, old in zip(after, before, strict=True))
            tokens_moved = any(new[0] != old[0] for new, old in zip(after, before, strict=True))
            assert moved > TOL or tokens_moved, (f"{label}: the served outputs did not move (max |logprob change| "
                                                 f"{moved:.4f}, tokens equal): stale weights?")
            moves[label] = "tokens" if tokens_moved else round(moved, 3)
            before = after
        print(f"\nmax |served - bf16 recompute| logprob, smallest greedy margin: "
              f"{({k: (round(a, 4), round(b, 3)) for k, (a, b) in worst.items()})}\n"
              f"each update moved the served outputs by (max |logprob change|, or tokens): {moves}")
    assert server.proc.returncode == 0, server.log.read_text()
