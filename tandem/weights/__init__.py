"""Moving weights from the trainer to inference servers: update descriptions (`meta`), the fleet
interface (`fleet`, `http_fleet`), the trainer-side driver (`update`), and the data planes
(`group`: the independent transfer group, `shm`: shared-memory buckets, `verify`: checksums).

`update` and `http_fleet` are imported lazily (they pull in aiohttp and the trainer's collectives);
the server side only needs `group`, `shm` and `verify`.
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
