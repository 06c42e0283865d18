"""Hostile bodies in Dynamo's forms of the ``/engine/*`` routes: a worker method that is not
on the route's map, a method of another framework's worker extension, wrong types inside
``update_info`` and ``init_info``, unknown nested fields, and a field given both beside a
nested object and inside it.  Each is refused with a code, and the worker's state is
unchanged: version, digest, commits and weights — with an update session open, so a refusal
that had half-applied anything would show as a written, torn or closed session."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dialect_worker import Served, served
from tests.helpers import perturbed
from weightsync.core.routes import ROUTES
from weightsync.core.schemas import DYNAMO_FORMS
from weightsync.edge.dynamo import FOREIGN, translate
from weightsync.testing.strategies import from_schema, hostile_json, hostile_values
from weightsync.trainer import save_checkpoint

__all__ = ["served"]

DOC = (Path(__file__).resolve().parents[2] / "docs" / "dialects.md").read_text()
INFO = {"names": ["embed.weight"], "dtype_names": ["float32"], "shapes": [[4]]}
INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}


@pytest.fixture
def in_session(served: Served) -> Iterator[Served]:
    """A paused worker with an update session open: refusals must leave it open and unwritten."""
    assert served.post("/engine/pause_generation", json={"mode": "keep"}).status_code == 200
    r = served.post("/engine/update_weights_from_distributed", json={"engine_rpc": "start_weight_update"})
    assert r.status_code == 200, r.text
    yield served


def refused_unchanged(served: Served, route: str, body: Any, status: int, code: str) -> dict[str, Any]:
    before = served.state()
    reply = served.post(f"/engine/{route}", json=body)
    assert reply.status_code == status, reply.text
    out = reply.json()
    assert out["status"] == "error" and out["code"] == code, out
    snap = served.controller.snapshot()
    assert served.state() == before and snap.session_open and not snap.torn
    return out


@pytest.mark.parametrize(
    ("route", "method"),
    [
        ("update_weights_from_distributed", "collective_rpc"),
        ("update_weights_from_distributed", "__init__"),
        ("update_weights_from_distributed", "reload_weights"),  # a disk method on the wrong route
        ("update_weights_from_distributed", "init_weight_transfer_engine"),
        ("update_weights_from_disk", "update_weights"),
        ("update_weights_from_disk", "load_weights"),
        ("update_weights_from_disk", "UPDATE_WEIGHTS_FROM_PATH"),
        ("update_weights_from_disk", ""),
        ("init_weights_update_group", "update_weights"),
        ("destroy_weights_update_group", "shutdown"),
    ],
)
def test_an_engine_rpc_not_on_the_routes_map_is_refused_and_changes_nothing(
    in_session: Served, route: str, method: str
) -> None:
    new = perturbed(in_session.engine.model.weights(), seed=5)
    path = save_checkpoint(new, in_session.root / "step")  # a body that would otherwise load
    body = {"engine_rpc": method, "model_path": str(path)}
    out = refused_unchanged(in_session, route, body, 400, "method_not_allowed")
    assert out["details"]["field"] == "engine_rpc"


@pytest.mark.parametrize("method", [None, 5, True, ["update_weights_from_path"], {"name": "reload_weights"}])
def test_an_engine_rpc_that_is_not_a_string_is_wrong_type(in_session: Served, method: Any) -> None:
    path = save_checkpoint(perturbed(in_session.engine.model.weights(), seed=6), in_session.root / "s")
    body = {"engine_rpc": method, "model_path": str(path)}
    refused_unchanged(in_session, "update_weights_from_disk", body, 400, "wrong_type")


@pytest.mark.parametrize(
    ("route", "body"),
    [  # prime-rl's bodies (prime_rl/inference/dynamo.py, DynamoAdminPlane._collective_rpc)
        ("update_weights_from_distributed",
         {"engine_rpc": "update_weights_from_path", "weight_dir": "/shared/step_1", "weight_version": 1}),
        ("init_weights_update_group",
         {"engine_rpc": "init_broadcaster", "host": "trainer", "port": 29501, "rank_offset": 0,
          "inference_world_size": 1, "timeout": 10, "quantize_in_weight_transfer": False, "session_id": "default"}),
        ("destroy_weights_update_group", {"engine_rpc": "destroy_broadcaster"}),
    ],
)  # fmt: skip
def test_a_worker_extensions_method_is_not_supported(
    in_session: Served, route: str, body: dict[str, Any]
) -> None:
    out = refused_unchanged(in_session, route, body, 501, "not_supported")
    assert out["details"]["field"] == "engine_rpc" and body["engine_rpc"] == FOREIGN[route]


def update(info: Any, **top: Any) -> tuple[str, dict[str, Any]]:
    return "update_weights_from_distributed", {"engine_rpc": "update_weights", "update_info": info, **top}


def init(info: Any, **top: Any) -> tuple[str, dict[str, Any]]:
    return "init_weights_update_group", {
        "engine_rpc": "init_weight_transfer_engine",
        "init_info": info,
        **top,
    }


def form(rpc: str, **top: Any) -> tuple[str, dict[str, Any]]:
    return "update_weights_from_distributed", {"engine_rpc": rpc, **top}


WRONG = [
    (update([]), 400, "wrong_type", "update_info"),
    (update("names"), 400, "wrong_type", "update_info"),
    (update(None), 400, "wrong_type", "update_info"),
    (update([INFO]), 400, "wrong_type", "update_info"),  # vLLM's per-rank list: one object per request
    (update({**INFO, "names": "embed.weight"}), 400, "wrong_type", "names"),
    (update({**INFO, "dtype_names": ["float4"]}), 400, "invalid_value", "dtypes[0]"),
    (update({**INFO, "shapes": [[-4]]}), 400, "invalid_value", "shapes[0][0]"),
    (update({**INFO, "shapes": [[4], [4]]}), 400, "invalid_value", None),
    (update({**INFO, "packed": "true"}), 400, "wrong_type", "update_info.packed"),
    (update({**INFO, "packed": True, "packed_buffer_size_bytes": 0}), 400, "invalid_value",
     "update_info.packed_buffer_size_bytes"),
    (update({**INFO, "packed_num_buffers": True}), 400, "wrong_type", "update_info.packed_num_buffers"),
    (update({**INFO, "hashes": ["zz"]}), 400, "invalid_value", "hashes[0]"),
    (update({"names": ["embed.weight"], "shapes": [[4]]}), 400, "missing_field", "update_info.dtype_names"),
    (form("update_weights"), 400, "missing_field", "update_info"),
    (form("update_weights", update_info=INFO, allow_unpaused="true"), 400, "wrong_type", "allow_unpaused"),
    (form("finish_weight_update", reset_prefix_cache=0), 400, "wrong_type", "reset_prefix_cache"),
    (form("start_weight_update", is_checkpoint_format="yes"), 400, "wrong_type", "is_checkpoint_format"),
    (form("start_weight_update", is_checkpoint_format=False), 501, "not_supported", "is_checkpoint_format"),
    (init("trainer:29500"), 400, "wrong_type", "init_info"),
    (init({**INIT, "master_port": "29500"}), 400, "wrong_type", "master_port"),
    (init({**INIT, "world_size": 1}), 400, "invalid_value", "world_size"),
    (init({**INIT, "rank_offset": 2}), 400, "invalid_value", "rank_offset"),
    (init({**INIT, "backend": "mpi"}), 400, "invalid_value", "backend"),
    (init({**INIT, "timeout_s": 0}), 400, "invalid_value", "timeout_s"),
    (init({**INIT, "packed": "no"}), 400, "wrong_type", "init_info.packed"),
    (init({**INIT, "packed_num_buffers": -1}), 400, "invalid_value", "init_info.packed_num_buffers"),
    (init({**INIT, "packed": True}), 501, "not_supported", "init_info.packed"),
    (init({**INIT, "nccl_unique_id_b64": "AAAA"}), 400, "conflicting_options", "init_info.nccl_unique_id_b64"),
    (init({"master_address": "trainer", "master_port": 29500}), 400, "missing_field", "init_info.rank_offset"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "status", "code", "field"), WRONG)
def test_a_wrong_type_or_value_inside_a_form_is_refused_before_anything_changes(
    in_session: Served, call: tuple[str, dict[str, Any]], status: int, code: str, field: str | None
) -> None:
    out = refused_unchanged(in_session, *call, status, code)
    if field is not None:
        assert out["details"]["field"] == field, out


UNKNOWN = [
    (update({**INFO, "ipc_handles": {"0": "gASV"}}), ["update_info.ipc_handles"]),
    (update({**INFO, "weight_version": 3}), ["update_info.weight_version"]),
    (update({**INFO, "group_name": "trainer"}), ["update_info.group_name"]),
    (update({**INFO, "dtypes": ["float32"]}), ["update_info.dtypes"]),
    (init({**INIT, "group_name": "trainer"}), ["init_info.group_name"]),
    (init({**INIT, "receiver": "inline"}), ["init_info.receiver"]),
    (form("start_weight_update", dry_run=True), ["dry_run"]),
    (form("update_weights", update_info=INFO, session=False), ["session"]),
    (form("finish_weight_update", names=["embed.weight"]), ["names"]),
    (init(INIT, timeout=10), ["timeout"]),
    (("destroy_weights_update_group", {"engine_rpc": "shutdown_weight_transfer_engine", "group_name": "x"}),
     ["group_name"]),
]  # fmt: skip


@pytest.mark.parametrize(("call", "fields"), UNKNOWN)
def test_an_unknown_field_inside_or_beside_a_form_is_refused(
    in_session: Served, call: tuple[str, dict[str, Any]], fields: list[str]
) -> None:
    out = refused_unchanged(in_session, *call, 400, "unknown_field")
    assert out["details"]["fields"] == fields


CONFLICTS = [
    (update(INFO, names=["embed.weight"]), ["names"]),
    (update(INFO, dtypes=["float32"]), ["dtypes"]),
    (update(INFO, dtype_names=["float32"], shapes=[[4]]), ["dtype_names", "shapes"]),
    (update(INFO, group_name="vllm"), ["group_name"]),
    (update(INFO, packing={"flat": True}), ["packing"]),
    (update(INFO, packed=True), ["packed"]),
    (update(INFO, hashes=["0" * 16]), ["hashes"]),
    (init(INIT, master_address="10.0.0.1"), ["master_address"]),
    (init(INIT, group_name="trainer", receiver="inline"), ["group_name", "receiver"]),
]  # fmt: skip


@pytest.mark.parametrize(("call", "fields"), CONFLICTS)
def test_a_field_beside_the_nested_object_that_carries_it_is_a_conflict(
    in_session: Served, call: tuple[str, dict[str, Any]], fields: list[str]
) -> None:
    out = refused_unchanged(in_session, *call, 400, "conflicting_options")
    assert out["details"]["fields"] == fields


def test_a_well_formed_update_on_a_group_never_joined_writes_nothing(in_session: Served) -> None:
    """The form is valid; the group ``vllm`` was never joined: refused before any collective,
    the session still open and unwritten."""
    names = list(in_session.engine.model.weights())[:1]
    t = in_session.engine.model.weights()[names[0]]
    info = {"names": names, "dtype_names": [str(t.dtype).removeprefix("torch.")], "shapes": [list(t.shape)]}
    out = refused_unchanged(in_session, *update(info), 404, "unknown_group")
    assert "vllm" in out["message"]


# ---------------------------------------------------------------- the map itself


def test_every_form_maps_onto_a_registry_route() -> None:
    minimal = {"update_info": INFO, "init_info": INIT, "model_path": "/ckpt"}
    for route, forms in DYNAMO_FORMS.items():
        for method, schema in forms.items():
            body = {"engine_rpc": method, **{k: minimal[k] for k in schema["required"] if k != "engine_rpc"}}
            target, _ = translate(route, body)
            assert target in ROUTES, (route, method, target)
    # weightsync's own bodies (no engine_rpc) are left as they are, for every route
    for route in ROUTES:
        assert translate(route, {"model_path": "/ckpt"}) == (route, {"model_path": "/ckpt"})


def test_every_dynamo_method_is_documented_in_dialects_md() -> None:
    section = DOC.split("## Dynamo's `/engine/*` routes", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", section))
    for forms in DYNAMO_FORMS.values():
        assert set(forms) <= documented, sorted(set(forms) - documented)
    assert set(FOREIGN.values()) <= documented


# ---------------------------------------------------------------- fuzz

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
# init_weight_transfer_engine would dial master_address: its fields are tested above instead.
FUZZED = [(route, method) for route, forms in DYNAMO_FORMS.items() for method in forms
          if route != "init_weights_update_group"]  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from tests.helpers import TINY
    from weightsync.core import Controller
    from weightsync.engines.reference import ReferenceEngine
    from weightsync.serve import ServerThread, create_app

    engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path_factory.mktemp("dynamo-fuzz")])
    with (
        ServerThread(create_app(Controller(engine))) as server,
        httpx.Client(base_url=server.url, headers={"content-type": "application/json"}) as http,
    ):
        yield http


def check(reply: httpx.Response) -> None:
    assert reply.status_code < 500 or reply.status_code == 501, reply.text
    body = reply.json()
    assert isinstance(body, dict) and body.get("status") in ("ok", "error"), body
    if reply.status_code >= 400:
        assert body["code"] and body["message"]


@pytest.mark.parametrize(("route", "method"), FUZZED)
def test_schema_valid_dynamo_bodies_never_5xx(fuzz_http: httpx.Client, route: str, method: str) -> None:
    @FUZZ
    @given(body=from_schema(DYNAMO_FORMS[route][method]))
    def fuzz(body: dict[str, Any]) -> None:
        check(fuzz_http.post(f"/engine/{route}", content=json.dumps(body)))

    fuzz()
    assert fuzz_http.get("/health").json()["alive"]


@FUZZ
@given(data=st.data())
def test_a_hostile_value_in_any_field_of_a_form_never_5xx(
    fuzz_http: httpx.Client, data: st.DataObject
) -> None:
    route, method = data.draw(st.sampled_from(FUZZED))
    schema = DYNAMO_FORMS[route][method]
    body = data.draw(from_schema(schema))
    body[data.draw(st.sampled_from(sorted(schema["properties"])))] = data.draw(hostile_values())
    check(fuzz_http.post(f"/engine/{route}", content=hostile_json(body)))
    assert fuzz_http.post("/engine/get_weight_version", json={}).status_code == 200
