"""Forced tool calls: `tool_choice` naming a function, or "required", answered through structured
output, as vLLM does it.

The model is constrained to write exactly what the tool call needs -- the named function's
arguments, or a JSON list of {"name", "parameters"} objects for "required" -- so the calls always
parse, whatever the model and its chat template know about tools. `tool_choice: "auto"` is the
model's own syntax, read by a tool-call parser (jaxserve.server.tool_parsers).

`functions` checks every request's tools (their shape and their parameters' JSON schemas), forced
or not, so a bad schema is a 400 naming it rather than a template error or a silent no-call.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from jaxserve.server.errors import ApiError
from jaxserve.structured import spec as guide
from jaxserve.structured.spec import GuideSpec

_ANY_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class ForcedTools:
    """How the constrained output turns into `tool_calls`."""

    spec: GuideSpec
    function: str | None  # the named function; None for "required" (names come in the output)

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The message's tool_calls for a complete constrained output."""
        if self.function is not None:
            return [_call(self.function, text)]
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in json.loads(text)]


def forced_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
                 parallel_tool_calls: bool | None = None) -> ForcedTools | None:
    """None unless tool_choice forces a call; 400 for a choice that names nothing callable."""
    if tool_choice in (None, "none", "auto"):
        return None
    if not tools:
        raise ApiError(400, "tools: tool_choice forcing a tool call needs tools", "tools")
    functions = function_schemas(tools)
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ForcedTools(guide.json_schema(schema, "tool_choice"), None)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise ApiError(400, f"tool_choice: no function named {name!r} in tools (have {sorted(functions)})",
                           "tool_choice")
        return ForcedTools(guide.json_schema(functions[name], "tool_choice"), name)
    raise ApiError(400, "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", "tool_choice")


def function_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool; 400 naming the tool for a bad shape, a duplicate
    name, or parameters that are not a valid JSON schema."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"parameters\"?}}}", "tools")
        if fn["name"] in out:
            raise ApiError(400, f"tools[{i}].function.name: {fn['name']!r} is defined twice", "tools")
        params = fn.get("parameters") or _ANY_OBJECT  # {} too: arguments are always an object
        if isinstance(params, dict) and "type" not in params:
            params = {**params, "type": "object"}
        # The meta-schema check; GuideError is a 400 naming the tool.
        guide.json_schema(params, f"tools[{i}].function.parameters")
        out[fn["name"]] = params
    return out


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_arguments(text: str, where: str) -> dict[str, Any]:
    """A call's arguments, sent as JSON text (OpenAI's form), as the object chat templates write
    (`arguments | tojson`); 400 naming `where` for text that is not a JSON object."""
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}: not JSON ({e})", where) from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}: expected a JSON object", where)
    return arguments

