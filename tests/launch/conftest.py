from __future__ import annotations

import pytest

from tandem.models.tiny import init_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("launch-models") / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0)


@pytest.fixture(scope="package")  # stopped after tests/launch
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm (`tests/launch/slurm_cluster.py`), shared by the Slurm tests;
    skipped, printing why, where one cannot run."""
    from tests.launch.slurm_cluster import SlurmCluster

    why = SlurmCluster.unavailable()
    if why:
        print(f"Slurm tests skipped: {why}")
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running
