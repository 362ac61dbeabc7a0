"""Tool calls in Qwen3.5's format, read out of a completion's text (what vLLM's `qwen3` parser reads):

    <tool_call>
    <function=run_python>
    <parameter=code>
    print(1 + 1)
    </parameter>
    </function>
    </tool_call>

    content, calls = parse_tool_calls(text, tools)     # calls: [ToolCall(name, arguments: dict)], or None

`content` is the text before the first `<tool_call>` (None when only whitespace). A parameter's value is kept as
the text between its tags (one leading and one trailing newline dropped); when the tool's JSON schema gives the
parameter a type other than string, the value is read as JSON when it parses (numbers, booleans, objects). A call
that is not well formed (a `<tool_call>` without its closing tag, no `<function=...>`, a tool the request did not
offer) makes the whole text a plain answer: `calls` is None and the caller returns the text as content, as vLLM
does, never an error.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional, Sequence

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def openai(self, call_id: str) -> dict:
        """The call in OpenAI's `tool_calls` shape (arguments as a JSON string)."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def _schemas(tools: Optional[Sequence[Any]]) -> dict:
    """name -> the JSON schema properties of each offered function tool."""
    out = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters") or {}
            out[function["name"]] = params.get("properties") or {} if isinstance(params, dict) else {}
    return out


def _value(text: str, schema: Any) -> Any:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_tool_calls(text: str, tools: Optional[Sequence[Any]] = None
                     ) -> tuple[Optional[str], Optional[list[ToolCall]]]:
    """(content, calls) of a completion's text (module docstring); calls is None when there is no well-formed call
    of an offered tool."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, None
    schemas = _schemas(tools)
    calls, at = [], start
    for match in _CALL.finditer(text, start):
        if text[at:match.start()].strip():  # text between calls: not a clean run of calls
            return text, None
        function = _FUNCTION.match(match.group(1))
        if function is None or (schemas and function.group(1) not in schemas):
            return text, None
        props = schemas.get(function.group(1), {})
        arguments = {name: _value(value, props.get(name)) for name, value in _PARAMETER.findall(function.group(2))}
        calls.append(ToolCall(function.group(1), arguments))
        at = match.end()
    if not calls or text[at:].strip():  # an unclosed call, or text after the last one
        return text, None
    content = text[:start]
    return (content if content.strip() else None), calls
