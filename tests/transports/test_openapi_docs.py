"""/docs works offline (Swagger UI assets served by the worker itself) and the OpenAPI
document describes the body fields and every error reply."""

from __future__ import annotations

import re

import httpx

from tests.transports.conftest import Worker
from weightsync.transports.http import schemas


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


def test_the_fuzzed_schemas_stay_free_of_documentation() -> None:
    # The strategies draw from BODIES; descriptions live only in the published copy.
    assert "description" not in str(schemas.BODIES)
    assert "description" in str(schemas.documented(schemas.BODIES["update_weights_from_disk"]))
