"""AReaL's distributed weight update, replayed against a real `tandem serve`.

Written from AReaL's code (inclusionAI/AReaL at 4aef98d), not from our server's:
- the trainer side forms the group as `FSDPEngine._init_weight_update_from_distributed`
  (areal/engine/fsdp_engine.py) does, through `init_custom_process_group`
  (areal/engine/core/distributed.py): torch's `tcp://` rendezvous as rank 0 of `world_size`, a
  `PrefixStore(group_name)`, torch's `_new_process_group_helper`, group name
  "update_weight_group", with `TORCHELASTIC_USE_AGENT_STORE=False`;
- the init request is `SGLangBackend.build_init_weights_group_request` (areal/engine/sglang_remote.py,
  PP=1): `master_port` as a string, `rank_offset = 1 + server_idx * tp * pp`, `world_size = gen
  world size + 1`, the platform's backend (gloo on CPU), sent before the trainer joins;
- each bucket is `build_distributed_weight_update_requests`: `names`, `dtypes` (torch dtype names
  without "torch."), `shapes`, `group_name`, `abort_all_requests: true` (no version, no commit), the
  request sent first, then one `dist.broadcast(src=0, group=pg)` per tensor, as
  `FSDPEngine._update_bucket_weights_from_distributed_async` does; buckets are a partial set each;
- `_update_weights_from_distributed` wraps them in `/pause_generation {}` ... `/continue_generation {}`
  (AReaL keeps the version on its side: `RemoteInfEngine.set_version` sends nothing).
"""

from __future__ import annotations

import pytest

from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights.verify import tensor_checksum
from tests.inference.areal_client import GROUP, areal_group_update
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import ServerProcess


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--weight-sync-timeout", "30")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def test_areal_trainer_updates_tandem_serve_in_two_partial_buckets(server, qwen3_dir, tmp_path):
    new = list(iter_hf_tensors(make_model_dir(tmp_path, "qwen3", seed=3)))
    old = dict(iter_hf_tensors(qwen3_dir))
    first, second = new[: len(new) // 2], new[len(new) // 2:]
    want = {n: tensor_checksum(t.contiguous()) for n, t in new}
    assert all(want[n] != tensor_checksum(old[n].contiguous()) for n, _ in new)

    def served() -> dict[str, str]:
        return server.ok("/get_weights_checksum", {})["checksums"]

    with areal_group_update(server) as send:
        for k, bucket in enumerate((first, second)):
            send(bucket)
            sums = served()
            # Each call's tensors are in place at once (SGLang's semantics), the rest untouched.
            done = {n for part in (first, second)[: k + 1] for n, _ in part}
            assert {n for n, _ in new if sums[n] == want[n]} == done
    assert served() == want
    server.ok("/destroy_weights_update_group", {"group_name": GROUP})
    out = server.ok("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert len(out["output_ids"]) == 2
