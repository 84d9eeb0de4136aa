"""Moving weights from the trainer to inference servers: `updater` (every trainer rank) runs
`two_phase` (pause, stage, commit, verify, version, continue) over a transport (`transports`:
disk, broadcast, shared memory) fed by a `source` (the training engine). Data planes: `group` (the
transfer process group), `shm` (segments), `verify` (checksums). The server side imports only
`group`, `shm` and `verify`.
"""

from tandem.weights.group import (
    WeightGroup,
    WeightGroupError,
    connect_store,
    dtype_from_name,
    host_store,
    init_weight_group,
)

__all__ = ["WeightGroup", "WeightGroupError", "connect_store", "dtype_from_name", "host_store", "init_weight_group"]
