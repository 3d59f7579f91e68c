"""The OpenAPI document declares what the handlers really take and answer: the request bodies
(the handlers read them themselves, to bound and validate them off the event loop, so FastAPI
cannot infer them) and the OpenAI-shaped error responses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvreuse.serve.protocol import ErrorResponse

WHY = {
    400: "Invalid request: the message names the field and what is allowed.",
    401: "The admin token is missing or wrong.",
    404: "No such endpoint.",
    409: "The prefix cache is in use.",
    413: "The request body exceeds the server's limit.",
    429: "Too many requests in flight; retry later.",
    500: "The request failed inside the step loop (the server goes on).",
    503: "The step loop is not running, or the server is shutting down.",
}
REF = "#/components/schemas/{model}"


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Route `responses` for these status codes (default: a generation endpoint's)."""
    return {
        c: {"model": ErrorResponse, "description": WHY[c]}
        for c in codes or (400, 413, 429, 500, 503)
    }


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add the request models (and their definitions) to the document's components."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template=REF)
                schemas.update(js.pop("$defs", {}))
                schemas[model.__name__] = js
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
