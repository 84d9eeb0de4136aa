"""The JSON wire form of `Fleet` calls between `RolloutCallback` (trainer workers) and the
controller's callback server: the one place that says which arguments each operation carries and
how each travels. Control plane only (no tensors).

`encode_call(op, **arguments)` is the body the callback POSTs to `/fleet/{op}`; `decode_call(op,
body)` gives back the `(args, kwargs)` the controller calls its own `Fleet` method with, which in
turn calls `HttpFleet`. Every argument of `HttpFleet`'s Fleet methods is in `FLEET_OPS` (a test
checks the signatures), so a feature added to the fleet interface (`commit`/`bucket_index`, shm
buckets, flat bucket layouts, checksums) reaches the servers through the controller too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tandem.weights.fleet import FleetResult, ServerChecksums, ServerResult
from tandem.weights.meta import Deadlines, FlatLayout, ParamSpec, ShmBucket, WeightUpdateMeta


# -- one value at a time ---------------------------------------------------------------------------
def meta_to_json(meta: WeightUpdateMeta) -> dict[str, Any]:
    return dataclasses.asdict(meta)


def meta_from_json(data: dict[str, Any]) -> WeightUpdateMeta:
    data = dict(data)
    data["deadlines"] = Deadlines(**data.get("deadlines", {}))
    return WeightUpdateMeta(**data)


def spec_to_json(spec: ParamSpec) -> dict[str, Any]:
    return {"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype}


def spec_from_json(data: dict[str, Any]) -> ParamSpec:
    return ParamSpec(str(data["name"]), tuple(int(d) for d in data["shape"]), str(data["dtype"]))


def bucket_to_json(bucket: ShmBucket) -> dict[str, Any]:
    return {"specs": [spec_to_json(s) for s in bucket.specs], "offsets": list(bucket.offsets),
            "nbytes": bucket.nbytes, "segment": bucket.segment, "cuda_ipc": bucket.cuda_ipc,
            "zero_copy": bucket.zero_copy}


def bucket_from_json(data: dict[str, Any]) -> ShmBucket:
    return ShmBucket(tuple(spec_from_json(s) for s in data["specs"]), tuple(int(o) for o in data["offsets"]),
                     int(data["nbytes"]), data.get("segment"), data.get("cuda_ipc"), bool(data.get("zero_copy", False)))


def flat_to_json(flat: FlatLayout) -> dict[str, Any]:
    return {"offsets": list(flat.offsets), "nbytes": flat.nbytes}


def flat_from_json(data: dict[str, Any]) -> FlatLayout:
    return FlatLayout(tuple(int(o) for o in data["offsets"]), int(data["nbytes"]))


def result_to_json(result: FleetResult) -> dict[str, Any]:
    return {"phase": result.phase, "results": [dataclasses.asdict(r) for r in result.results]}


def result_from_json(data: dict[str, Any]) -> FleetResult:
    return FleetResult(str(data["phase"]), tuple(ServerResult(**r) for r in data.get("results", [])))


def checksums_to_json(checksums: dict[str, ServerChecksums]) -> dict[str, Any]:
    return {a: dataclasses.asdict(c) for a, c in checksums.items()}


def checksums_from_json(data: dict[str, Any]) -> dict[str, ServerChecksums]:
    return {a: ServerChecksums(**c) for a, c in data.items()}


# -- whole calls -----------------------------------------------------------------------------------
def _optional(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else fn(v)


# argument -> (to JSON, from JSON); None travels as null for the optional ones.
_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "meta": (meta_to_json, meta_from_json),
    "specs": (lambda specs: [spec_to_json(s) for s in specs], lambda data: [spec_from_json(s) for s in data]),
    "bucket": (bucket_to_json, bucket_from_json),
    "flat": (_optional(flat_to_json), _optional(flat_from_json)),
    "commit": (bool, bool),
    "bucket_index": (_optional(int), _optional(int)),
    "version": (int, int),
    "names": (_optional(list), _optional(lambda names: [str(n) for n in names])),
}

# op -> (positional arguments, keyword-only arguments with their defaults), as in `Fleet`.
FLEET_OPS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "pause_generation": ((), {}),
    "continue_generation": ((), {}),
    "set_version": (("version",), {}),
    "init_weights_update_group": (("meta",), {}),
    "update_weights_from_distributed": (("meta", "specs"), {"commit": True, "bucket_index": None, "flat": None}),
    "update_weights_from_shm": (("meta", "bucket"), {"commit": True, "bucket_index": None}),
    "destroy_weights_update_group": (("meta",), {}),
    "update_weights_from_disk": (("meta",), {"commit": True}),
    "commit_weights": (("meta",), {}),
    "discard_weights": (("meta",), {}),
    "weight_checksums": (("names",), {}),
}


def encode_call(op: str, **arguments: Any) -> dict[str, Any]:
    """The JSON body of `op` called with `arguments` (every argument of the op, by name)."""
    positional, keywords = FLEET_OPS[op]
    expected = set(positional) | set(keywords)
    if set(arguments) != expected:
        raise TypeError(f"fleet operation {op!r} takes {sorted(expected)}, got {sorted(arguments)}")
    return {name: _CODECS[name][0](value) for name, value in arguments.items()}


def decode_call(op: str, body: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """`(args, kwargs)` of `op` from its JSON body; raises KeyError/TypeError/ValueError when the
    body is malformed. A keyword missing from the body takes its default."""
    if op not in FLEET_OPS:
        raise ValueError(f"unknown fleet operation {op!r}")
    positional, keywords = FLEET_OPS[op]
    args = [_CODECS[name][1](body.get(name) if name == "names" else body[name]) for name in positional]
    kwargs = {name: default if body.get(name) is None else _CODECS[name][1](body[name])
              for name, default in keywords.items()}
    return args, kwargs
