"""``POST /v1/completions``: an OpenAI-compatible subset, with weight-version stamps."""

from __future__ import annotations

import time
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightsync.core.errors import InvalidRequest, WeightSyncError
from weightsync.core.validation import Body, array, integer, string
from weightsync.edge.dialects import DEFAULT_VERSION
from weightsync.serve import schemas
from weightsync.serve.edge import bearer_check, internal_error, read_json_body
from weightsync.serve.metrics import Metrics
from weightsync.serve.replies import JSONReply, error_response


class GeneratingEngine(Protocol):
    name: str

    async def generate(
        self,
        prompt: list[int],
        *,
        max_tokens: int = ...,
        temperature: float = ...,
        seed: int | None = ...,
        request_id: str | None = ...,
    ) -> Any: ...


SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds are 64-bit signed integers, as every engine's generators take them."""


def _prompt(field: str, value: Any) -> list[int]:
    if type(value) is str:
        if not value:
            raise InvalidRequest("prompt must not be empty", code="invalid_value", field=field)
        try:
            return list(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequest(
                "prompt is not valid UTF-8 text (it holds a lone surrogate)",
                code="invalid_value",
                field=field,
            ) from None
    if type(value) is list:
        return array(field, value, lambda f, v: integer(f, v, lo=0))
    raise InvalidRequest("prompt must be a string or an array of token ids", code="wrong_type", field=field)


def _temperature(field: str, value: Any) -> float:
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise InvalidRequest("temperature must be a number >= 0", code="invalid_value", field=field)
    return float(value)


def parse_completion(body: Any) -> dict[str, Any]:
    b = Body(body, ("model", "prompt", "max_tokens", "temperature", "seed", "request_id"))
    b.get("model", lambda f, v: v if type(v) is str else string(f, v), "")
    return {
        "prompt": b.get("prompt", _prompt),
        "max_tokens": b.get("max_tokens", lambda f, v: integer(f, v, lo=1), 16),
        "temperature": b.get("temperature", _temperature, 0.0),
        "seed": b.get("seed", lambda f, v: integer(f, v, *SEED_RANGE), None),
        "request_id": b.get("request_id", string, None),
    }


def add_completion_routes(
    app: FastAPI, engine: GeneratingEngine, *, api_key: str | None, metrics: Metrics
) -> None:
    check = bearer_check(api_key)

    @app.post(
        "/v1/completions",
        summary="OpenAI-style completion, stamped with the weight version(s) that produced it.",
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/json": {
                        "schema": schemas.documented(schemas.COMPLETION, schemas.COMPLETION_DOCS)
                    }
                }
            },
            "responses": schemas.error_responses(schemas.COMPLETION_ERRORS),
        },
    )
    async def completions(request: Request) -> JSONResponse:
        try:
            check(request)
            args = parse_completion(await read_json_body(request))
            out = await engine.generate(**args)
        except WeightSyncError as exc:
            return error_response(exc)
        except Exception as exc:  # answer, log, keep serving
            return internal_error(exc)
        metrics.completions.labels(out.finish_reason).inc()
        return JSONReply(
            {
                "id": out.id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": engine.name,
                "choices": [
                    {
                        "index": 0,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": len(out.token_ids),
                    "cached_tokens": out.cached_tokens,
                },
                "weight_version": out.weight_version,
                "weight_version_declared": out.version_declared,
                "weight_version_current": out.version_current,
                "weight_version_spans": [s.to_reply() for s in out.spans],
                # SGLang's place for it (its OpenAI replies' `metadata`), "default" while undeclared
                "metadata": {
                    "weight_version": out.weight_version if out.version_declared else DEFAULT_VERSION
                },
            }
        )
