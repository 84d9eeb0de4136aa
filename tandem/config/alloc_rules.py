"""Rules of allocation modes beyond syntax: parallel size arithmetic and component naming."""

from __future__ import annotations

from tandem.config.alloc_syntax import INFERENCE_BACKENDS, Dim, RawComponent
from tandem.config.parallel_sizes import ParallelSizes
from tandem.errors import AllocationError


def _size(dims: dict[str, Dim], letter: str) -> int:
    return dims[letter].size if letter in dims else 1


def resolve_sizes(raw: RawComponent, spec: str) -> ParallelSizes:
    """The parallel sizes `raw` asks for; raises `AllocationError` at the offending letter when
    the expert layout does not tile the devices."""
    if raw.attn is not None:
        return _hybrid_sizes(raw, spec)
    dims = raw.dims
    dp, tp, pp, cp, ep = (_size(dims, k) for k in "dtpce")
    if ep == 1:
        return ParallelSizes(dp, tp, pp, cp)
    # Plain form with experts: like AReaL, expert tensor parallelism stays off (etp = 1) and the
    # experts are split over ep * pp devices, replicated edp = world / (ep * pp) times. Use the
    # hybrid attn/ffn form to set etp.
    world, etp = dp * tp * pp * cp, 1
    group = ep * etp * pp
    if world % group:
        raise AllocationError(
            f"expert parallel size e{ep} times pipeline size p{pp} (= {group}) must divide the world "
            f"size d*t*p*c = {world}; change 'e', or use the hybrid form to lay experts out separately",
            spec,
            dims["e"].pos,
        )
    return ParallelSizes(dp, tp, pp, cp, ep)  # edp = world / (ep * pp)


def _hybrid_sizes(raw: RawComponent, spec: str) -> ParallelSizes:
    assert raw.attn is not None and raw.ffn is not None and raw.ffn_pos is not None
    attn, ffn = raw.attn, raw.ffn
    dp, tp, pp, cp = (_size(attn, k) for k in "dtpc")
    ep, etp = _size(ffn, "e"), _size(ffn, "t")
    world = dp * tp * pp * cp
    if "p" in ffn and ffn["p"].size != pp:
        raise AllocationError(
            f"expert pipeline size p{ffn['p'].size} must equal the attention pipeline size p{pp}; "
            "omit 'p' in the ffn section to inherit it",
            spec,
            ffn["p"].pos,
        )
    group = ep * etp * pp
    if "d" not in ffn:
        if world % group:
            raise AllocationError(
                f"cannot derive the expert dp: the attention world size {world} (d*t*p*c) is not "
                f"divisible by ep*etp*pp = {ep}*{etp}*{pp} = {group}; change 'e' or 't' in the ffn section",
                spec,
                raw.ffn_pos,
            )
        return ParallelSizes(dp, tp, pp, cp, ep, etp, edp=world // group)
    edp = ffn["d"].size
    if edp * group != world:
        raise AllocationError(
            f"expert world size {edp}*{ep}*{etp}*{pp} = {edp * group} (d*e*t*p) does not match the "
            f"attention world size {dp}*{tp}*{pp}*{cp} = {world} (d*t*p*c); fix the dims, or omit 'd' "
            "in the ffn section to derive it",
            spec,
            raw.ffn_pos,
        )
    return ParallelSizes(dp, tp, pp, cp, ep, etp, edp)


def check_names(groups: list[list[RawComponent]], spec: str) -> None:
    """Colocated members after the first need names; 3+ components all do; names are unique."""
    for group in groups:
        for member in group[1:]:
            if member.name is None:
                raise AllocationError(
                    f"colocated component {member.backend!r} needs a name, e.g. "
                    f"'{member.backend}[ref]:...'; only the first member of a '|' group may be unnamed",
                    spec,
                    member.start,
                )
    flat = [c for group in groups for c in group]
    if len(flat) >= 3:
        for comp in flat:
            if comp.name is None:
                example = "rollout" if comp.backend in INFERENCE_BACKENDS else "actor"
                raise AllocationError(
                    f"with {len(flat)} components every component needs a name, e.g. "
                    f"'{comp.backend}[{example}]:...'",
                    spec,
                    comp.start,
                )
    seen: set[str] = set()
    for comp in flat:
        if comp.name is not None and comp.name in seen:
            raise AllocationError(
                f"component name {comp.name!r} is used twice; names must be unique", spec, comp.name_pos
            )
        if comp.name is not None:
            seen.add(comp.name)


def check_colocation(group: list[RawComponent], sizes: list[ParallelSizes], spec: str) -> None:
    """Members of a '|' group share the first member's devices, so they need as many."""
    first, want = group[0], sizes[0].world_size
    for member, member_sizes in zip(group[1:], sizes[1:], strict=True):
        if member_sizes.world_size != want:
            raise AllocationError(
                f"colocated components must have equal world sizes: {first.name or first.backend!r} "
                f"uses {want} devices but {member.name!r} uses {member_sizes.world_size}; change the dims "
                f"so both use {want}",
                spec,
                member.start,
            )
