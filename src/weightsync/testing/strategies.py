"""Hypothesis strategies for weightsync commands and request bodies."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from weightsync.core.routes import ROUTES

ROUTE_NAMES = sorted(ROUTES)


def json_values(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value: the space of legal version labels (``null`` and ``"initial"`` included)."""
    scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=12)
    scalars = scalars | st.floats(allow_nan=False, allow_infinity=False) | st.just("initial")
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=max_leaves,
    )


not_booleans = st.sampled_from(["false", "true", 0, 1, None, [], {}, "yes"])
"""Values a lax parser might take for a boolean; weightsync must refuse each."""

pause_modes = st.sampled_from(["keep", "wait", "abort"])


@st.composite
def pause_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["mode"] = draw(pause_modes)
    if draw(st.booleans()):
        body["clear_cache"] = draw(st.booleans())
    return body


@st.composite
def update_flags(draw: st.DrawFn) -> dict[str, Any]:
    """``allow_unpaused`` / ``reset_prefix_cache``, each omitted or given (conflicts included)."""
    flags: dict[str, Any] = {}
    for name in ("allow_unpaused", "reset_prefix_cache"):
        if draw(st.booleans()):
            flags[name] = draw(st.booleans())
    return flags


@st.composite
def bad_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """A route and a body that its parser must refuse (400), whatever the state."""
    routes = ["set_weight_version", "pause_generation", "update_weights_from_disk",
              "init_weights_update_group", "abort_request", "resume_generation"]  # fmt: skip
    route = draw(st.sampled_from(routes))
    choice = draw(st.integers(0, 3))
    if choice == 0:  # not an object
        return route, draw(st.sampled_from([[], "x", 3, None, True, [{}]]))
    if choice == 1:  # unknown field
        return route, {"no_such_field_" + draw(st.text("abc", min_size=1, max_size=4)): 1}
    if choice == 2:  # a strict boolean given a non-boolean
        field = {"pause_generation": "clear_cache"}.get(route, "allow_unpaused")
        body: dict[str, Any] = {field: draw(not_booleans)}
        if route == "update_weights_from_disk":
            body["model_path"] = "ok:x"
        if route in ("pause_generation", "update_weights_from_disk"):
            return route, body
        return "update_weights_from_disk", {"model_path": "ok:x", "allow_unpaused": body[field]}
    # missing a required field
    missing: list[tuple[str, Any]] = [
        ("set_weight_version", {}),
        ("update_weights_from_disk", {}),
        ("abort_request", {}),
        ("init_weights_update_group", {"group_name": "g"}),
    ]
    return draw(st.sampled_from(missing))


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under ``schema``, for the JSON Schema subset weightsync publishes
    (``type``, ``enum``, ``properties``/``required``, ``items``/``minItems``, numeric bounds,
    ``minLength``, ``oneOf``; an empty schema means any JSON value)."""
    if not schema:
        return json_values(max_leaves=4)
    if "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema["oneOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=20)
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**31)), schema.get("maximum", 2**31))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1e9))
        high = schema.get("maximum", 1e9)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "array":
        items = from_schema(schema["items"]) if "items" in schema else json_values(max_leaves=2)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=4)
    if kind == "object":
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(st.text(max_size=5), json_values(max_leaves=2), max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    raise ValueError(f"unsupported schema {schema!r}")


# ----------------------------------------------------------------------------- hostile shapes
#
# What a hostile or broken client sends: values the JSON grammar allows but a worker cannot
# write back (lone surrogates, non-finite numbers, integers beyond 64 bits, deep nesting),
# and names a parser lets through that the layer below may not take (dtypes, segment names).
# Encode them with :func:`hostile_json`: ``json.dumps`` writes a lone surrogate as
# ``"\ud800"`` and a non-finite float as ``NaN`` / ``Infinity``, exactly as they arrive.

lone_surrogates = st.builds(
    lambda before, s, after: before + s + after,
    st.text(max_size=3),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.text(max_size=3),
)
"""Strings holding a lone surrogate: valid JSON text (``"\\ud800"``), not valid UTF-8."""

non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
"""Written as the ``NaN`` / ``Infinity`` literals that JSON does not have (``1e400`` parses to inf)."""

huge_ints = st.one_of(
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.integers(min_value=2**64, max_value=10**300),
)
"""Integers beyond 64 bits, which JSON allows and C-level code overflows on."""


def nested(depth: int, leaf: Any = 0, as_object: bool = False) -> Any:
    """A value ``depth`` containers deep (lists, or objects keyed ``"a"``), built without recursion."""
    value = leaf
    for _ in range(depth):
        value = {"a": value} if as_object else [value]
    return value


deep_values = st.builds(nested, st.integers(33, 60), st.just(0), st.booleans())
"""Values nested beyond the 32 levels a version may have, shallow enough for ``json.dumps``."""


class DeepJSON(bytes):
    """JSON text nested ``depth`` levels deep; its repr stays short in hypothesis reports."""

    depth: int

    def __repr__(self) -> str:
        return f"<JSON nested {self.depth} deep>"


def deep_json_text(depth: int, as_object: bool = False) -> DeepJSON:
    """``[[[...]]]`` or ``{"a":{"a":...0}}``, ``depth`` levels deep, written without recursion."""
    if as_object:
        text = DeepJSON(b'{"a":' * depth + b"0" + b"}" * depth)
    else:
        text = DeepJSON(b"[" * depth + b"]" * depth)
    text.depth = depth
    return text


deep_json_texts = st.builds(
    deep_json_text, st.sampled_from([1_000, 10_000, 100_000, 200_000]) | st.integers(33, 3_000), st.booleans()
)
"""JSON text nested far deeper than any stack (up to 200k levels): arrays or objects."""


long_strings = st.builds(lambda c, n: c * n, st.sampled_from("x€"), st.integers(20_000, 70_000))
"""Strings around the 64 KiB a version may take when serialised (``€`` is 3 bytes of UTF-8)."""


def hostile_values() -> st.SearchStrategy[Any]:
    """JSON-grammar values a worker must refuse or write back unchanged, never choke on:
    lone surrogates (as values and as keys), non-finite numbers, huge integers, deep nesting,
    long strings, mixed into ordinary values."""
    leaves = lone_surrogates | non_finite | huge_ints | deep_values | long_strings
    bad_keys = st.dictionaries(lone_surrogates, json_values(max_leaves=2), min_size=1, max_size=2)
    return st.recursive(
        leaves | bad_keys | json_values(max_leaves=2),
        lambda inner: (
            st.lists(inner, min_size=1, max_size=3)
            | st.dictionaries(st.text(max_size=5) | lone_surrogates, inner, min_size=1, max_size=3)
        ),
        max_leaves=4,
    )


def hostile_json(value: Any) -> bytes:
    """``value`` as the JSON text a hostile client sends (lone surrogates escaped, ``NaN``/``Infinity``)."""
    return json.dumps(value, ensure_ascii=True, allow_nan=True).encode()


odd_dtypes = st.sampled_from(
    [
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3fn",
        "float8_e5m2",
        "complex64",
        "complex128",
        "torch.bfloat16",
        "torch.",
        "bfloat16 ",
        "BFloat16",
        "float",
        "half",
        "complex32",
        "uint16",
        "uint32",
        "uint64",
        "qint8",
        "",
        "\ud800",
        "bool\x00",
    ]
)
"""Dtype names at the edges: ones the parser knows but few engines serve (fp8 ``fnuz``,
complex), ones it must refuse (aliases, case, padding, NUL, a lone surrogate)."""

odd_segment_names = st.one_of(
    st.sampled_from(
        [
            "weightsync_a/b",
            "weightsync_../../etc/passwd",
            "weightsync_",
            "weightsync_" + "x" * 300,
            "/weightsync_abc",
            "weightsync_a\x00b",
            "weightsync_\ud800",
            "weightsync_.",
            "weightsync_ a",
            "psm_12345",
            "",
            ".",
            "..",
            "weightsync_nonexistent_segment",
        ]
    ),
    st.text(max_size=20).map(lambda s: "weightsync_" + s),
)
"""Shared-memory segment names a request may carry: separators, traversal, NUL, over-long
(300 characters), empty, foreign prefixes, and arbitrary text after the prefix."""


@st.composite
def odd_tensor_handles(draw: st.DrawFn) -> dict[str, Any]:
    """One ``update_weights_from_tensor`` entry with an odd dtype, segment name or offset."""
    return {
        "name": draw(st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "nope"])),
        "dtype": draw(odd_dtypes | st.just("float32")),
        "shape": draw(st.sampled_from([[64], [0], [2**62], [64, 1]])),
        "handle": {
            "shm": draw(odd_segment_names),
            "offset": draw(st.sampled_from([0, 1, -1, 2**63]) | huge_ints),
        },
    }
