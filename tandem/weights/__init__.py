"""Moving weights between trainer and inference servers: the independent transfer group."""

from tandem.weights.group import (
    WeightGroup,
    WeightGroupError,
    connect_store,
    dtype_from_name,
    host_store,
    init_weight_group,
)

__all__ = ["WeightGroup", "WeightGroupError", "connect_store", "dtype_from_name", "host_store", "init_weight_group"]
