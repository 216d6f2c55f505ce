"""The OpenAPI document, with the request bodies the routes parse themselves.

Routes read their body through `parse` (strict, with OpenAI's error shapes), so FastAPI does not
see their schemas; this adds them, so /openapi.json describes what the server accepts and the
test suite can fuzz the endpoints from it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make app.openapi() describe `bodies` (POST path -> request model)."""

    def build() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                    },
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build
