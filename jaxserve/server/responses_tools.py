"""Function tools on the Responses API, in chat completions' terms.

The Responses API spells tools flat (`{"type": "function", "name", "parameters", "strict"}`),
`tool_choice` as `{"type": "function", "name"}`, a call as a `function_call` item with a
`call_id`, and its result as a `function_call_output` item. Here they become what chat templates
and jaxserve.server.answers take: nested tools, chat's tool_choice, an assistant message carrying
`tool_calls` (arguments as objects) and a `tool` message. Hosted tools (web search, file search,
MCP, code interpreter, ...) need a service this server does not run: 400 naming the tool.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.server.errors import ApiError
from jaxserve.server.tools import parse_arguments

_FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Responses tools as chat tools; 400 naming a tool that is not a function."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools[{i}].type: only function tools are served here, got {kind!r} (hosted "
                           "tools need a service this server does not run)", f"tools[{i}].type")
        unknown = sorted(set(tool) - _FUNCTION_KEYS)
        if unknown:
            raise ApiError(400, f"tools[{i}]: unknown field(s) {unknown}", f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError(400, f"tools[{i}].name: expected the function's name", f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses tool_choice as chat's: "none" / "auto" / "required" as they are, a function by name."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                   "tool_choice")


def add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function_call input item, on the assistant turn it belongs to (one turn may call several)."""
    name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.name: expected the function's name", f"{where}.name")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(400, f"{where}.call_id: expected the call's id", f"{where}.call_id")
    if not isinstance(arguments, str):
        raise ApiError(400, f"{where}.arguments: expected a JSON object as text", f"{where}.arguments")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": parse_arguments(arguments, f"{where}.arguments")}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":  # the turn's text, then its calls
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def call_output(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call_output input item as the tool message answering an earlier call."""
    call_id, output = item.get("call_id"), item.get("output")
    made = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    if call_id not in made:
        raise ApiError(400, f"{where}.call_id: {call_id!r} answers no function_call before it", f"{where}.call_id")
    if not isinstance(output, str):
        raise ApiError(400, f"{where}.output: expected the call's result as a string", f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """A function_call output item."""
    return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
