"""Hypothesis strategies for weightsync commands and request bodies."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from weightsync.core.requests import PARSERS

ROUTE_NAMES = sorted([*PARSERS, "engine_rpc"])


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
        return st.floats(low, 1e9, exclude_min="exclusiveMinimum" in schema, allow_nan=False)
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
