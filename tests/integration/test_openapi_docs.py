"""/docs works offline (Swagger UI assets served by the worker itself) and the OpenAPI
document describes the body fields and every error reply."""

from __future__ import annotations

import re
from typing import Any

import httpx

from tests.workers import Worker
from weightsync.serve import schemas


def test_docs_page_loads_only_assets_the_worker_serves(worker: Worker) -> None:
    page = httpx.get(f"{worker.url}/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert assets, page.text
    for asset in assets:
        assert not asset.startswith(("http:", "https:", "//")), f"/docs loads {asset} from elsewhere"
        reply = httpx.get(f"{worker.url}{asset}")
        assert reply.status_code == 200 and len(reply.content) > 100, asset
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    assert any(a.endswith("swagger-ui.css") for a in assets)


def test_openapi_lists_every_error_reply_with_its_codes(worker: Worker) -> None:
    spec = httpx.get(f"{worker.url}/openapi.json").json()
    for path in ("/engine/update_weights_from_disk", "/engine/resume_generation"):
        responses = spec["paths"][path]["post"]["responses"]
        for status in ("400", "401", "403", "404", "409", "413", "415", "500", "501", "503"):
            assert status in responses, (path, status)
            assert "Codes: " in responses[status]["description"]
    resume = spec["paths"]["/engine/resume_generation"]["post"]["responses"]
    assert "weights_torn" in resume["409"]["description"]
    assert "unsupported_media_type" in resume["415"]["description"]


def test_openapi_body_schemas_describe_their_fields(worker: Worker) -> None:
    spec = httpx.get(f"{worker.url}/openapi.json").json()
    for path, item in spec["paths"].items():
        if not path.startswith("/engine/") or "post" not in item:
            continue
        schema = item["post"]["requestBody"]["content"]["application/json"]["schema"]
        for field, sub in schema.get("properties", {}).items():
            assert sub.get("description"), f"{path}: field {field} has no description"


def _undocumented(schema: dict[str, Any], at: str) -> list[str]:
    """Fields without a description anywhere in ``schema``: nested objects and array items too."""
    missing = []
    if isinstance(schema.get("items"), dict):
        missing += _undocumented(schema["items"], f"{at}[]")
    for field, sub in schema.get("properties", {}).items():
        if not sub.get("description"):
            missing.append(f"{at}.{field}")
        missing += _undocumented(sub, f"{at}.{field}")
    return missing


def test_openapi_describes_every_field_of_every_body_down_to_nested_ones(worker: Worker) -> None:
    spec = httpx.get(f"{worker.url}/openapi.json").json()
    missing = []
    for path, item in spec["paths"].items():
        if "post" in item and "requestBody" in item["post"]:
            missing += _undocumented(
                item["post"]["requestBody"]["content"]["application/json"]["schema"], path
            )
    assert not missing, missing
    tensors = spec["paths"]["/engine/update_weights_from_tensor"]["post"]["requestBody"]
    item = tensors["content"]["application/json"]["schema"]["properties"]["tensors"]["items"]
    assert set(item["properties"]) == {"name", "dtype", "shape", "handle"}
    assert "/v1/completions" in spec["paths"]


def test_openapi_lists_the_error_replies_of_completions(worker: Worker) -> None:
    spec = httpx.get(f"{worker.url}/openapi.json").json()
    responses = spec["paths"]["/v1/completions"]["post"]["responses"]
    for status in ("400", "401", "403", "413", "415", "500", "503"):
        assert status in responses and "Codes: " in responses[status]["description"], status
    assert "invalid_json" in responses["400"]["description"]
    assert responses["400"]["content"]["application/json"]["schema"] == schemas.ERROR
    assert "weights_mismatch" not in responses["400"]["description"]  # an admin route's code


def test_the_fuzzed_schemas_stay_free_of_documentation() -> None:
    # The strategies draw from BODIES; descriptions live only in the published copy.
    assert "description" not in str(schemas.BODIES)
    assert "description" not in str(schemas.COMPLETION)
    assert "description" in str(schemas.documented(schemas.BODIES["update_weights_from_disk"]))
