"""Allocation-mode grammar: one section per rule, valid and invalid cases, plus properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.config.alloc import MEGATRON_NOTE, AllocationMode, Component, parse_allocation
from tandem.config.alloc_syntax import BACKEND_DIMS
from tandem.errors import AllocationError, ConfigError

JSON_KEYS = ["backend", "name", "dp", "tp", "pp", "cp", "ep", "etp", "edp", "world_size", "scheduling", "target"]  # fmt: skip


def fail(spec: str, fragment: str, at: str | int | None) -> AllocationError:
    """Parse `spec`, expect an AllocationError whose reason has `fragment` and whose position is
    `at` (an index, None, or a marker string whose first occurrence in `spec` is the position)."""
    with pytest.raises(AllocationError) as info:
        parse_allocation(spec)
    err = info.value
    assert fragment in err.reason, err.reason
    want = spec.index(at) if isinstance(at, str) else at
    assert err.position == want, (err.position, want, str(err))
    assert err.spec == spec
    if want is not None:
        assert str(err).endswith("\n  " + " " * want + "^")
    return err


def dims(comp: Component) -> tuple[int, ...]:
    return (comp.sizes.dp, comp.sizes.tp, comp.sizes.pp, comp.sizes.cp, comp.sizes.ep, comp.sizes.etp, comp.sizes.edp, comp.sizes.world_size)


# --- shape of the result -----------------------------------------------------------------------


def test_example_from_the_brief():
    mode = parse_allocation("sglang:d4t2+archon:d4p2t2")
    assert isinstance(mode, AllocationMode)
    gen, train = mode.components
    assert (gen.backend, gen.name, gen.is_inference) == ("sglang", None, True)
    assert dims(gen) == (4, 2, 1, 1, 1, 1, 4, 8)
    assert (train.backend, train.is_inference) == ("archon", False)
    assert dims(train) == (4, 2, 2, 1, 1, 1, 4, 16)
    assert mode.inference == (gen,) and mode.train == (train,)
    assert mode.total_devices == 24
    assert gen.devices == range(0, 8) and train.devices == range(8, 24)


def test_to_json_has_exactly_the_twelve_keys_in_order():
    out = parse_allocation("vllm[gen]:d2+fsdp[actor]:d2t2c2").to_json()
    assert list(out) == ["components"]
    assert [list(c) for c in out["components"]] == [JSON_KEYS, JSON_KEYS]
    assert out["components"][1] == {
        "backend": "fsdp", "name": "actor", "dp": 2, "tp": 2, "pp": 1, "cp": 2, "ep": 1, "etp": 1,
        "edp": 2, "world_size": 8, "scheduling": "separation", "target": None,
    }  # fmt: skip


def test_explain_lists_every_component_and_the_total():
    text = parse_allocation("sglang[rollout]:d2+archon[actor]:d4|archon[ref]:d4").explain()
    assert text.splitlines() == [
        "sglang[rollout] (inference): dp=2 tp=1 pp=1 cp=1 ep=1 etp=1, expert dp=2, world size 2, devices 0-1, separation",
        "archon[actor] (training): dp=4 tp=1 pp=1 cp=1 ep=1 etp=1, expert dp=4, world size 4, devices 2-5, separation",
        "archon[ref] (training): dp=4 tp=1 pp=1 cp=1 ep=1 etp=1, expert dp=4, world size 4, devices 2-5, colocation with actor",
        "total devices: 6",
    ]
    assert "device 0," in parse_allocation("vllm:d1").explain()


def test_lookup_by_name():
    mode = parse_allocation("sglang[rollout]:d2+archon[actor]:d2")
    assert mode["actor"].backend == "archon"
    with pytest.raises(KeyError):
        mode["critic"]


def test_error_is_a_config_error_and_rejects_non_strings():
    assert issubclass(AllocationError, ConfigError)
    with pytest.raises(AllocationError, match="must be a string"):
        parse_allocation(None)  # type: ignore[arg-type]


# --- rule: '+' separates devices, '|' colocates and binds tighter ---------------------------------


def test_plus_gives_consecutive_disjoint_device_ranges():
    mode = parse_allocation("sglang[a]:d2+sglang[b]:t3+archon[c]:d4")
    assert [c.devices for c in mode.components] == [range(0, 2), range(2, 5), range(5, 9)]
    assert all(c.scheduling == "separation" and c.target is None for c in mode.components)
    assert mode.total_devices == 9


def test_pipe_binds_tighter_than_plus():
    # a+b|c is a+(b|c): b and c share devices 2-5, a is alone on 0-1.
    a, b, c = parse_allocation("sglang[a]:d2+archon[b]:d4|archon[c]:d2t2").components
    assert a.devices == range(0, 2) and b.devices == c.devices == range(2, 6)
    assert (b.scheduling, b.target) == ("separation", None)
    assert (c.scheduling, c.target) == ("colocation", "b")
    assert parse_allocation("sglang[a]:d2+archon[b]:d4|archon[c]:d2t2").total_devices == 6


def test_colocation_target_is_the_backend_when_the_first_member_is_unnamed():
    first, second = parse_allocation("archon:d4|megatron[ref]:d4").components
    assert (first.scheduling, first.target) == ("separation", None)
    assert (second.scheduling, second.target) == ("colocation", "archon")


def test_colocating_inference_with_training_is_allowed():
    gen, actor = parse_allocation("sglang:d4|archon[actor]:d2t2").components
    assert gen.devices == actor.devices == range(4)


@pytest.mark.parametrize(
    ("spec", "fragment", "at"),
    [
        pytest.param("sglang:d4+", "nothing follows the trailing '+'", "+", id="trailing-plus"),
        pytest.param("sglang:d4|", "nothing follows the trailing '|'", "|", id="trailing-pipe"),
        pytest.param("+sglang:d4", "empty component before '+'", 0, id="leading-plus"),
        pytest.param("|sglang:d4", "empty component before '|'", 0, id="leading-pipe"),
        pytest.param("sglang:d4++archon:d4", "empty component between '+' and '+'", 10, id="double-plus"),
        pytest.param("sglang:d4+|archon:d4", "empty component between '+' and '|'", "|", id="plus-pipe"),
        pytest.param("sglang:d4,t2", "unexpected character ','", ",", id="comma"),
        pytest.param(
            "sglang:d4 archon:d4", "missing '+' or '|' before backend 'archon'", 10, id="missing-operator"
        ),
    ],
)
def test_operator_errors(spec, fragment, at):
    fail(spec, fragment, at)


def test_empty_spec_is_a_whole_string_error():
    fail("", "allocation mode is empty", None)
    fail(" \t\n", "allocation mode is empty", None)


# --- rule: optional names in brackets ------------------------------------------------------------


def test_names():
    gen, train = parse_allocation("sglang[rollout]:d2+archon[_actor2]:d2").components
    assert (gen.name, train.name) == ("rollout", "_actor2")
    assert train.label == "_actor2" and gen.label == "rollout"
    assert parse_allocation("sglang:d2").components[0].label == "sglang"


@pytest.mark.parametrize(
    ("spec", "fragment", "at"),
    [
        pytest.param("sglang[rollout:d2", "unbalanced '['", "[", id="unclosed-bracket"),
        pytest.param("sglang[rollout", "unbalanced '['", "[", id="unclosed-bracket-at-end"),
        pytest.param("sglang]:d2", "unbalanced ']'", "]", id="stray-close-bracket"),
        pytest.param("sglang:d2]", "unbalanced ']'", "]", id="close-bracket-after-dims"),
        pytest.param("sglang[]:d2", "empty component name", "]", id="empty-name"),
        pytest.param("sglang[1st]:d2", "must start with a letter or '_'", "1", id="digit-first"),
        pytest.param("sglang[a-b]:d2", "invalid character '-'", "-", id="bad-char"),
        pytest.param("sglang:d2[x]", "a name goes between the backend and ':'", "[", id="name-after-dims"),
    ],
)
def test_name_syntax_errors(spec, fragment, at):
    fail(spec, fragment, at)


# --- rule: whitespace anywhere is ignored --------------------------------------------------------


def test_whitespace_is_ignored_even_inside_tokens():
    plain = parse_allocation("sglang[rollout]:d4t2+archon:(attn:d2p2|ffn:e2)")
    spaced = parse_allocation(" sg lang [ roll out ] : d 4 t\t2 +\narchon : ( attn : d2 p2 | ffn : e 2 ) ")
    assert spaced.to_json() == plain.to_json()
    assert spaced.spec.startswith(" sg lang")  # the original string is kept


def test_error_positions_index_the_original_string_with_whitespace():
    fail("sglang : d 2  d 2", "given twice", 14)
    fail("  sglang:d4 +  ", "nothing follows the trailing '+'", "+")
    fail("sglang :  ", "expected dimensions", 8)  # end of input: just after the last character


# --- rule: backends and their dimensions -------------------------------------------------------


@pytest.mark.parametrize("backend", ["sglang", "vllm", "tandem"])
def test_inference_backends_take_d_t_p(backend):
    (comp,) = parse_allocation(f"{backend}:p2t2d2").components
    assert comp.is_inference and comp.launchable and comp.launch_error is None
    assert dims(comp) == (2, 2, 2, 1, 1, 1, 2, 8)


@pytest.mark.parametrize("letter", ["c", "e"])
@pytest.mark.parametrize("backend", ["sglang", "vllm", "tandem"])
def test_inference_backends_reject_c_and_e(backend, letter):
    fail(
        f"{backend}:d4{letter}2",
        f"dimension {letter!r} is not valid for inference backend {backend!r} (allowed: d, t, p)",
        len(f"{backend}:d4"),
    )


def test_archon_takes_all_five_dims():
    (comp,) = parse_allocation("archon:d2p2t2c2e2").components
    assert dims(comp) == (2, 2, 2, 2, 2, 1, 4, 16)
    assert comp.launchable


def test_fsdp_takes_only_d_t_c():
    (comp,) = parse_allocation("fsdp:c2t2d2").components
    assert dims(comp) == (2, 2, 1, 2, 1, 1, 2, 8)
    for letter in "pe":
        fail(f"fsdp:d2{letter}2", "not valid for training backend 'fsdp' (allowed: d, t, c)", 7)


def test_megatron_parses_but_is_not_launchable():
    mode = parse_allocation("sglang:d2+megatron:d2p2t2c2e2")
    comp = mode.components[1]
    assert dims(comp) == (2, 2, 2, 2, 2, 1, 4, 16)
    assert not comp.launchable and not mode.launchable
    assert comp.launch_error == MEGATRON_NOTE
    assert "cannot launch" in MEGATRON_NOTE and "use archon with the same dims" in MEGATRON_NOTE
    assert f"  note: {MEGATRON_NOTE}" in mode.explain().splitlines()
    assert parse_allocation("sglang:d2+archon:d2").launchable


@pytest.mark.parametrize(
    ("spec", "fragment", "at"),
    [
        pytest.param("d4t2", "a backend is required before the dimensions", 0, id="bare-dims"),
        pytest.param(
            "d4e2", "a backend is required before the dimensions, e.g. 'archon:d4e2'", 0, id="bare-moe-dims"
        ),
        pytest.param("sglang:d2+d4t2", "a backend is required", "d4t2", id="bare-dims-second"),
        pytest.param("[actor]:d4", "a backend is required before the name", 0, id="bare-name"),
        pytest.param(
            "(attn:d2|ffn:e2)", "a backend is required before the hybrid layout", 0, id="bare-hybrid"
        ),
        pytest.param("attn:d2|ffn:e2", "a backend is required before the hybrid layout", 0, id="bare-attn"),
        pytest.param(":d4", "a component starts with a backend", 0, id="colon-first"),
        pytest.param("foo:d4", "unknown backend 'foo'", 0, id="unknown"),
        pytest.param("sglang:d2+trt:d2", "unknown backend 'trt'", "trt", id="unknown-second"),
        pytest.param("SGLang:d4", "backend names are lowercase: write 'sglang'", 0, id="uppercase"),
        pytest.param("sglang", "expected ':' after backend 'sglang'", 6, id="no-colon"),
        pytest.param("sglang.d4", "expected ':' after backend 'sglang'", ".", id="dot"),
        pytest.param("sglang:", "expected dimensions for inference backend 'sglang'", 7, id="no-dims"),
        pytest.param("sglang:+archon:d2", "expected dimensions", "+", id="no-dims-before-plus"),
        pytest.param(
            "archon:x2",
            "dimension 'x' is not valid for training backend 'archon' (allowed: d, p, t, c, e)",
            "x",
            id="unknown-letter",
        ),
        pytest.param("sglang:D4", "dimension 'D' is not valid", "D", id="uppercase-letter"),
    ],
)
def test_backend_errors(spec, fragment, at):
    fail(spec, fragment, at)


# --- rule: sizes are integers >= 1 without leading zeros; order free; no repeats; default 1 --------


def test_omitted_dims_are_one_and_order_is_free():
    assert dims(parse_allocation("archon:t2").components[0]) == (1, 2, 1, 1, 1, 1, 1, 2)
    assert parse_allocation("sglang:t2d4").to_json() == parse_allocation("sglang:d4t2").to_json()
    assert parse_allocation("sglang:d10").components[0].sizes.dp == 10


@pytest.mark.parametrize(
    ("spec", "fragment", "at"),
    [
        pytest.param("sglang:d0", "size of dimension 'd' must be at least 1", "0", id="zero"),
        pytest.param("sglang:d00", "must be at least 1", "0", id="double-zero"),
        pytest.param(
            "sglang:d01", "size '01' of dimension 'd' has a leading zero; write 'd1'", "0", id="leading-zero"
        ),
        pytest.param("archon:t2d010", "leading zero; write 'd10'", "0", id="leading-zero-two-digits"),
        pytest.param("sglang:d2d2", "dimension 'd' is given twice", 9, id="repeat"),
        pytest.param("archon:d2t2p2t4", "dimension 't' is given twice", 13, id="repeat-later"),
        pytest.param("sglang:dt2", "dimension 'd' needs a size", "t", id="no-size"),
        pytest.param("sglang:d", "dimension 'd' needs a size", 8, id="no-size-at-end"),
        pytest.param("sglang:d-2", "dimension 'd' needs a size", "-", id="negative"),
        pytest.param("sglang:d2.5", "unexpected character '.'", ".", id="fraction"),
    ],
)
def test_size_errors(spec, fragment, at):
    fail(spec, fragment, at)


# --- rule: expert parallelism in the plain form -------------------------------------------------


def test_plain_expert_parallelism_derives_edp_with_etp_one():
    (comp,) = parse_allocation("archon:d4t2e4").components
    assert (comp.sizes.ep, comp.sizes.etp, comp.sizes.edp, comp.sizes.world_size) == (4, 1, 2, 8)
    (comp,) = parse_allocation("archon:d2p2e2").components
    assert (comp.sizes.ep, comp.sizes.etp, comp.sizes.edp, comp.sizes.world_size) == (2, 1, 1, 4)
    assert not comp.hybrid


def test_plain_expert_parallelism_must_divide_the_world():
    fail("archon:d2e4", "e4 times pipeline size p1 (= 4) must divide the world size d*t*p*c = 2", "e")
    fail("archon:d2p2e4", "(= 8) must divide the world size d*t*p*c = 4", "e")


# --- rule: hybrid MoE layout --------------------------------------------------------------------


def test_hybrid_layout_with_and_without_parentheses():
    with_parens = parse_allocation("archon:(attn:d1p4t2c2|ffn:d1p4t1e4)")
    without = parse_allocation("archon:attn:d1p4t2c2|ffn:d1p4t1e4")
    assert with_parens.to_json() == without.to_json()
    (comp,) = without.components
    assert dims(comp) == (1, 2, 4, 2, 4, 1, 1, 16)
    assert comp.hybrid and comp.scheduling == "separation"


def test_hybrid_expert_tensor_parallel_and_derived_expert_dp():
    (comp,) = parse_allocation("archon:(attn:d8t2|ffn:e4t2)").components
    assert (comp.sizes.ep, comp.sizes.etp, comp.sizes.edp, comp.sizes.pp, comp.sizes.world_size) == (4, 2, 2, 1, 16)


def test_hybrid_expert_pp_is_inherited_or_must_match():
    inherited = parse_allocation("archon:(attn:d4p2|ffn:e2)").components[0]
    explicit = parse_allocation("archon:(attn:d4p2|ffn:e2p2)").components[0]
    assert dims(inherited) == dims(explicit) == (4, 1, 2, 1, 2, 1, 2, 8)
    fail(
        "archon:(attn:d2p2|ffn:e2p4)", "expert pipeline size p4 must equal the attention pipeline size p2", 24
    )


def test_hybrid_expert_dp_must_divide_or_match():
    fail("archon:(attn:d6|ffn:e4)", "cannot derive the expert dp: the attention world size 6", "ffn")
    fail(
        "archon:(attn:d4|ffn:d4e2)",
        "expert world size 4*2*1*1 = 8 (d*e*t*p) does not match the attention world size 4*1*1*1 = 4",
        "ffn",
    )
    (comp,) = parse_allocation("archon:(attn:d4|ffn:d2e2)").components
    assert comp.sizes.edp == 2


def test_hybrid_then_colocation():
    actor, ref = parse_allocation("archon[actor]:attn:d2t2|ffn:e2|archon[ref]:d4").components
    assert (actor.sizes.ep, actor.sizes.edp, ref.target, ref.devices) == (2, 2, "actor", range(4))
    paren = parse_allocation("archon[actor]:(attn:d2t2|ffn:e2)|archon[ref]:d4")
    assert paren.to_json() == parse_allocation("archon[actor]:attn:d2t2|ffn:e2|archon[ref]:d4").to_json()


def test_megatron_hybrid_parses():
    (comp,) = parse_allocation("megatron:(attn:d1p12t4|ffn:d1p12e4)").components
    assert (comp.sizes.pp, comp.sizes.ep, comp.sizes.edp, comp.sizes.world_size, comp.launchable) == (12, 4, 1, 48, False)


@pytest.mark.parametrize(
    ("spec", "fragment", "at"),
    [
        pytest.param("archon:(attn:d2|ffn:e2", "unbalanced '('", "(", id="unclosed-paren"),
        pytest.param("archon:attn:d2|ffn:e2)", "unbalanced ')'", ")", id="stray-close-paren"),
        pytest.param("archon:(attn:d2|ffn:e2))", "unbalanced ')'", 23, id="double-close-paren"),
        pytest.param(
            "archon:attn:d2|archon[b]:d2",
            "expected 'ffn:' after '|' in the hybrid layout",
            "archon[b]",
            id="pipe-is-not-colocation",
        ),
        pytest.param("archon:attn:d2", "needs an expert section", 14, id="no-ffn"),
        pytest.param("archon:attn:d2+sglang:d2", "needs an expert section", "+", id="no-ffn-before-plus"),
        pytest.param("archon:(ffn:e2|attn:d2)", "starts with 'attn:'", "f", id="ffn-first"),
        pytest.param("archon:(d2)", "starts with 'attn:'", "d", id="paren-without-attn"),
        pytest.param("archon:attn|ffn:e2", "starts with 'attn:'", 7, id="attn-without-colon"),
        pytest.param(
            "archon:(attn:|ffn:e2)", "expected dimensions for the attention section", "|", id="empty-attn"
        ),
        pytest.param(
            "archon:(attn:d2e2|ffn:e2)",
            "dimension 'e' is not valid for the attention section 'attn:' (allowed: d, t, p, c)",
            "e",
            id="e-in-attn",
        ),
        pytest.param(
            "archon:(attn:d2|ffn:e2c2)",
            "dimension 'c' is not valid for the expert section 'ffn:' (allowed: d, e, t, p)",
            22,
            id="c-in-ffn",
        ),
        pytest.param("archon:(attn:d2|ffn:e2e2)", "dimension 'e' is given twice", 22, id="repeat-in-ffn"),
        pytest.param(
            "fsdp:(attn:d2|ffn:e2)", "backend 'fsdp' does not take the hybrid attn/ffn layout", "(", id="fsdp"
        ),
        pytest.param("sglang:attn:d2|ffn:e2", "backend 'sglang' does not take the hybrid", 7, id="inference"),
    ],
)
def test_hybrid_errors(spec, fragment, at):
    fail(spec, fragment, at)


# --- rule: names with three or more components, uniqueness, colocation --------------------------


@pytest.mark.parametrize(
    ("spec", "fragment", "at"),
    [
        pytest.param(
            "sglang:d2+archon:d2+fsdp:d2",
            "with 3 components every component needs a name",
            0,
            id="three-unnamed",
        ),
        pytest.param("sglang[r]:d2+archon[a]:d2+fsdp:d2", "with 3 components", "fsdp", id="third-unnamed"),
        pytest.param("sglang:d2+archon[a]:d4|archon[c]:d4", "with 3 components", 0, id="colocated-count"),
        pytest.param(
            "archon:d4|archon:d4", "colocated component 'archon' needs a name", 10, id="colocated-unnamed"
        ),
        pytest.param("sglang[a]:d2+archon[a]:d2", "component name 'a' is used twice", 20, id="duplicate"),
        pytest.param(
            "archon[x]:d4|archon[x]:d4", "component name 'x' is used twice", 20, id="duplicate-colocated"
        ),
        pytest.param(
            "archon[a]:d4|archon[b]:d2",
            "colocated components must have equal world sizes: 'a' uses 4 devices but 'b' uses 2",
            "archon[b]",
            id="world-mismatch",
        ),
        pytest.param(
            "archon:d4|sglang[gen]:t8",
            "'archon' uses 4 devices but 'gen' uses 8",
            "sglang",
            id="world-mismatch-unnamed-first",
        ),
    ],
)
def test_naming_and_colocation_errors(spec, fragment, at):
    fail(spec, fragment, at)


def test_two_components_need_no_names():
    assert [c.name for c in parse_allocation("archon:d4+archon:d4").components] == [None, None]


# --- properties ---------------------------------------------------------------------------------

SIZES = st.integers(min_value=1, max_value=12)


@st.composite
def plain_component(draw) -> tuple[str, dict[str, int]]:
    """A backend and a non-empty valid dims mapping (with 'e' dividing the world when present)."""
    backend = draw(st.sampled_from(sorted(BACKEND_DIMS)))
    letters = [k for k in BACKEND_DIMS[backend] if k != "e"]
    chosen = draw(st.lists(st.sampled_from(letters), min_size=1, unique=True))
    sizes = {k: draw(SIZES) for k in chosen}
    if "e" in BACKEND_DIMS[backend] and draw(st.booleans()):
        non_pp = math.prod(v for k, v in sizes.items() if k != "p")
        sizes["e"] = draw(st.sampled_from([n for n in range(1, non_pp + 1) if non_pp % n == 0]))
    return backend, sizes


def render(backend: str, sizes: dict[str, int], order: list[str] | None = None) -> str:
    return backend + ":" + "".join(f"{k}{sizes[k]}" for k in (order or list(sizes)))


@given(plain_component(), st.randoms())
def test_property_dimension_order_does_not_matter(component, rnd):
    backend, sizes = component
    order = list(sizes)
    rnd.shuffle(order)
    assert (
        parse_allocation(render(backend, sizes, order)).to_json()
        == parse_allocation(render(backend, sizes)).to_json()
    )


@given(plain_component())
def test_property_world_size_is_the_product_of_dims(component):
    backend, sizes = component
    (comp,) = parse_allocation(render(backend, sizes)).components
    get = sizes.get
    assert comp.sizes.world_size == get("d", 1) * get("t", 1) * get("p", 1) * get("c", 1)
    assert comp.devices == range(comp.sizes.world_size)
    assert (comp.sizes.ep, comp.sizes.etp) == (get("e", 1), 1)
    if comp.sizes.ep > 1:
        assert comp.sizes.edp * comp.sizes.ep * comp.sizes.etp * comp.sizes.pp == comp.sizes.world_size
    else:
        assert comp.sizes.edp == comp.sizes.dp


@given(
    attn=st.fixed_dictionaries({k: SIZES for k in "dtpc"}),
    ep=st.integers(1, 8),
    etp=st.integers(1, 4),
)
def test_property_hybrid_expert_world_matches_attention_world(attn, ep, etp):
    spec = f"archon:(attn:{''.join(f'{k}{v}' for k, v in attn.items())}|ffn:e{ep}t{etp})"
    world = math.prod(attn.values())
    if world % (ep * etp * attn["p"]):
        fail(spec, "cannot derive the expert dp", "ffn")
        return
    (comp,) = parse_allocation(spec).components
    assert comp.sizes.edp * comp.sizes.ep * comp.sizes.etp * comp.sizes.pp == comp.sizes.world_size == world


@given(st.lists(plain_component(), min_size=1, max_size=5))
def test_property_separated_components_tile_the_devices(components):
    spec = "+".join(render(f"{b}[c{i}]", s) for i, (b, s) in enumerate(components))
    mode = parse_allocation(spec)
    starts = [c.devices.start for c in mode.components]
    assert starts == [0, *[c.devices.stop for c in mode.components[:-1]]]
    assert mode.total_devices == sum(c.sizes.world_size for c in mode.components)


VALID_SPECS = [
    "sglang:d4t2+archon:d4p2t2",
    "sglang[rollout]:d2+archon[actor]:d4|archon[ref]:d4",
    "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)",
    "archon[a]:attn:d2t2|ffn:e2|megatron[b]:d4",
    "vllm:p2t2+fsdp:c2d2",
]
INVALID_SPECS = [
    "d4t2", "sglang:d4+", "sglang:d4e2", "sglang:d01", "sglang:d2d2", "sglang[x:d2",
    "archon:(attn:d2|ffn:e2", "archon:attn:d2|archon[b]:d2", "archon:d2e4", "archon:(attn:d4|ffn:d4e2)",
    "sglang:d2+archon:d2+fsdp:d2", "archon[a]:d4|archon[b]:d2", "sglang[a]:d2+archon[a]:d2", "foo:d2",
]  # fmt: skip


def sprinkle(spec: str, data) -> str:
    """Insert random whitespace runs between (and around) the characters of `spec`."""
    gaps = st.text(alphabet=" \t\n", max_size=2)
    return "".join(data.draw(gaps) + ch for ch in spec) + data.draw(gaps)


@given(st.sampled_from(VALID_SPECS), st.data())
def test_property_whitespace_does_not_change_a_valid_result(spec, data):
    spaced = sprinkle(spec, data)
    assert parse_allocation(spaced).explain() == parse_allocation(spec).explain()
    assert parse_allocation(spaced).to_json() == parse_allocation(spec).to_json()


@given(st.sampled_from(INVALID_SPECS), st.data())
def test_property_whitespace_keeps_the_error_and_its_character(spec, data):
    spaced = sprinkle(spec, data)
    with pytest.raises(AllocationError) as plain_info:
        parse_allocation(spec)
    with pytest.raises(AllocationError) as spaced_info:
        parse_allocation(spaced)
    plain, got = plain_info.value, spaced_info.value
    assert got.reason == plain.reason
    assert (got.position is None) == (plain.position is None)
    if plain.position is not None:
        assert got.position is not None

        # Same character: as many non-space characters precede it in both strings.
        def before(s: str, p: int) -> int:
            return sum(not ch.isspace() for ch in s[:p])

        assert before(spaced, got.position) == before(spec, plain.position)
        assert got.position == len(spaced.rstrip()) or not spaced[got.position].isspace()


@given(st.sampled_from(["d", "t", "p"]), st.integers(0, 99), st.integers(1, 3))
def test_property_leading_zeros_are_rejected(letter, value, zeros):
    fail(f"sglang:{letter}{'0' * zeros}{value}", "must be at least 1" if value == 0 else "leading zero", "0")
