"""GET /openapi.json: every registered route, with the JSON schema of its request body."""

from __future__ import annotations

import re
from typing import Any

from quart import Quart

from jaxserve import __version__

_ARG = re.compile(r"<(?:\w+:)?(\w+)>")


def openapi_spec(app: Quart) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        view = app.view_functions[rule.endpoint]
        path = _ARG.sub(r"{\1}", rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            op: dict[str, Any] = {"summary": (view.__doc__ or "").strip().split("\n")[0] or rule.endpoint,
                                  "responses": {"200": {"description": "OK"}}}
            params = [{"name": a, "in": "path", "required": True, "schema": {"type": "string"}} for a in rule.arguments]
            if params:
                op["parameters"] = params
            model = getattr(view, "request_model", None)
            if model is not None:
                schema = model.model_json_schema()
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
            paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "jaxserve", "version": __version__}, "paths": paths}
