"""Tandem's trainer updating a server that lacks staged commit (SGLang's semantics), tried against a
real `tandem serve` driven through the `sglang` adapter: no commit/discard route exists there, so
each bucket (or the checkpoint) must be applied on arrival, and the version set after the last."""

from __future__ import annotations

import pytest

from tandem.fleet.adapters import adapter_for
from tandem.fleet.http import HttpFleet
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import WeightSyncError
from tandem.weights.updater import WeightUpdater
from tests.inference.conftest import make_model_dir
from tests.weights.common import (
    BUCKET,
    FAST,
    CheckpointSource,
    expected_checksums,
    served_checksums,
    start_server,
    version_of,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=11)
    weights = tmp_path_factory.mktemp("weights")
    server = start_server(model_dir, tmp_path_factory.mktemp("serve"), weights)
    yield model_dir, weights, server
    assert server.stop() == 0, server.log.read_text()


def _meta(kind: str, weights) -> WeightUpdateMeta:
    return WeightUpdateMeta(type=kind, path=str(weights / "versions") if kind == "disk" else None,
                            bucket_bytes=BUCKET, deadlines=FAST)


def test_updates_fall_back_to_sglang_semantics(setup):
    model_dir, weights, server = setup
    with HttpFleet([server.url], adapter=adapter_for("sglang"), deadlines=FAST) as fleet:
        assert not fleet.capabilities.staged_commit
        for kind, version in (("distributed", 21), ("disk", 22)):
            src = CheckpointSource(model_dir, scale=1.0 + version / 100)
            with WeightUpdater(src, fleet, _meta(kind, weights)) as updater:
                report = updater.update(version)
            assert kind == "disk" or report.buckets >= 5, report
            assert served_checksums(server) == expected_checksums(src.tensors), kind
            assert version_of(server) == str(version)


def test_a_failed_unstaged_update_says_the_servers_may_hold_part_of_it(setup):
    model_dir, weights, server = setup
    src = CheckpointSource(model_dir, scale=1.3)
    last = list(src.tensors)[-1]  # in the last bucket: the buckets before it land
    broken = CheckpointSource(model_dir, scale=1.3, break_shape=last)
    before = served_checksums(server)
    with HttpFleet([server.url], adapter=adapter_for("sglang"), deadlines=FAST) as fleet:
        with WeightUpdater(broken, fleet, _meta("distributed", weights)) as updater, \
                pytest.raises(WeightSyncError, match="may hold part of this update"):
            updater.update(31)
        after = served_checksums(server)
        want = expected_checksums(src.tensors)
        assert after[last] == before[last] and after[next(iter(src.tensors))] == want[next(iter(src.tensors))]
        with WeightUpdater(src, fleet, _meta("distributed", weights)) as updater:  # updating again repairs it
            updater.update(32)
    assert served_checksums(server) == want and version_of(server) == "32"
