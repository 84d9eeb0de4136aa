"""Adapter-only weight updates, end to end: a LoRA trainer (one rank, and FSDP over two) trains a
step, then updates two real `tandem serve` servers with its adapter alone by disk, distributed
broadcast (pipelined and serial) and shared memory. After each update every server's weights
equal the trainer's merged export bit for bit (the server merged the adapter into its base copy
the way the trainer merges), the adapter's checksums were verified (`verify=True`), its logprobs
equal the trainer's own within 1e-5 (fp32, staleness 0) and the update moved a small fraction of
the bytes of a whole-weights update."""

from __future__ import annotations

import pytest
import torch

from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines
from tandem.models.common.lora import LoRAConfig
from tandem.train import SequenceBatch, TrainEngine
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.updater import WeightUpdater
from tests.distributed import run_distributed
from tests.inference.conftest import make_model_dir
from tests.train.helpers import engine_config, make_batch, weighted_loss
from tests.weights.common import NEW, expected_checksums, post_ok, sample_everywhere, start_server

pytestmark = pytest.mark.slow
STEPS = (("disk", True), ("distributed", True), ("distributed", False), ("shm", True))
DEADLINES = Deadlines(init_group_s=30, bucket_s=30, update_s=120, http_s=30)
LORA = LoRAConfig(rank=4, alpha=8.0)


def _worker(rank: int, world: int, model_dir: str, urls: list[str], root: str, first_version: int) -> list[dict]:
    engine = TrainEngine(engine_config(model_dir, lora=LORA))
    fleet = HttpFleet(urls, deadlines=DEADLINES) if rank == 0 else None
    batch = make_batch(engine.model.args.vocab_size)
    results = []
    for i, (kind, pipeline) in enumerate(STEPS):
        engine.train_batch(batch, weighted_loss)
        version = first_version + i
        meta = WeightUpdateMeta(type=kind, path=f"{root}/versions", bucket_bytes=8 * 1024, deadlines=DEADLINES,
                                lora_alpha=LORA.alpha)
        engine.sync_adapters = True  # what TrainWorker.init_weight_update does for such a meta
        with WeightUpdater(engine, fleet, meta, pipeline=pipeline, verify=True) as updater:
            report = updater.update(version)
        merged = {n: t.clone() for b in engine.export_weights(1 << 30, torch.float32, adapter_only=False)
                  for n, t in b}  # collective
        gens = sample_everywhere(urls, rank, world, temperature=1.0, seed=7)
        trainer_lps = engine.forward_logprobs(SequenceBatch.from_token_lists([p + out for _, p, out, _, _ in gens]),
                                              temperature=1.0).logprobs  # collective
        if rank != 0:
            continue
        row = {"kind": kind, "pipeline": pipeline, "version": version, "verified": report.verified,
               "bytes": report.bytes, "weights_equal": [], "versions": [],
               "lp_vs_trainer": 0.0}
        want = expected_checksums(merged)
        for url in urls:
            row["weights_equal"].append(post_ok(url, "/get_weights_checksum", {})["checksums"] == want)
        for (_, prompt, _, lps, served), lp in zip(gens, trainer_lps, strict=True):
            row["versions"].append(served)
            mine = lp[len(prompt) - 1: len(prompt) - 1 + NEW].tolist()
            row["lp_vs_trainer"] = max(row["lp_vs_trainer"], max(abs(a - b) for a, b in zip(lps, mine, strict=True)))
        results.append(row)
    engine.sync_adapters = False
    whole = engine.export_nbytes(torch.float32)
    for row in results:
        row["whole_bytes"] = whole
    if fleet is not None:
        fleet.close()
    engine.close()
    return results


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=5)
    log_dir = tmp_path_factory.mktemp("serve")
    weights_dir = tmp_path_factory.getbasetemp()
    procs = [start_server(model_dir, log_dir, weights_dir), start_server(model_dir, log_dir, weights_dir)]
    yield model_dir, procs
    for s in procs:
        assert s.stop() == 0, s.log.read_text()


@pytest.mark.parametrize("world", [1, 2], ids=["d1", "d2"])
def test_adapter_updates_reach_every_server_exactly(servers, world, tmp_path):
    model_dir, procs = servers
    first = 10 * world
    (rows, *_) = run_distributed(_worker, world, args=(str(model_dir), [s.url for s in procs], str(tmp_path), first),
                                 timeout=240)
    assert [(r["kind"], r["pipeline"]) for r in rows] == list(STEPS)
    for r in rows:
        label = f"world {world} {r['kind']}{'' if r['pipeline'] else ' (serial)'}"
        print(f"\n[{label}] {r['bytes']} bytes (whole weights: {r['whole_bytes']}), max |logprob diff| vs trainer "
              f"{r['lp_vs_trainer']:.2e}")
        assert r["verified"], label
        assert all(r["weights_equal"]), (label, r)
        assert set(r["versions"]) == {str(r["version"])}, (label, r)
        assert r["lp_vs_trainer"] <= 1e-5, (label, r)
        assert 0 < r["bytes"] * 5 < r["whole_bytes"], (label, r)
