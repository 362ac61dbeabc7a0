"""The OpenAI API of `launchers.serve` as vLLM speaks it: request models, the error shape and the pieces of a
response (jaxrl/serve/handlers.py answers with them; the stopping rule is jaxrl/generation/stopping.py, the
per-token texts jaxrl/serve/text.py).

Request models are validated by FastAPI (pydantic): a field of the wrong type or out of range is HTTP 422 with
the OpenAI error shape, naming the field. Unknown fields are ignored, as vLLM does. Fields this server cannot
honour are refused with HTTP 400 naming the field when they carry anything but their neutral value (penalties,
logit_bias, beam search, suffix, tool_choice other than auto / none, best_of > n, ...): silently different sampling
would be worse. `tools` are given to the chat template and the calls the model writes in Qwen3.5's format come back
as `tool_calls` (jaxrl/data/tool_calls.py).
"""

from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               413: "RequestEntityTooLarge", 422: "UnprocessableEntityError", 500: "InternalServerError",
               499: "ClientClosedRequest", 503: "ServiceUnavailableError"}
JAXRL_SERVER = "jaxrl"  # the "server" field of /version (vLLM's has only "version"): how a client tells them apart
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any number. Each is searched in every completion's text.
# Characters of one stop string: each is tokenised and searched in every completion's text, so its length is CPU
# every row pays (sixteen 1.9 MB strings held the server for 32 s); a real stop string is a few words.
MAX_STOP_CHARS = 1024
MAX_SEED = 2 ** 63  # request seeds are int64, as vLLM's; -1 is vLLM's "no seed"


class ApiError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = int(status), param

    @property
    def kind(self) -> str:
        if self.status in ERROR_TYPES:
            return ERROR_TYPES[self.status]
        return HTTPStatus(self.status).phrase.replace(" ", "") + "Error"

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


# ---------------------------------------------------------------------------------------------------------------
# Request models


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Request):
    """The fields completions and chat completions share (OpenAI's and vLLM's extra sampling fields)."""

    model: Optional[str] = None
    n: int = Field(1, ge=1)
    best_of: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=-1, lt=MAX_SEED)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False
    # Extensions (jaxrl): each choice's `token_versions` (per token, an index into its `version_digests`: the
    # adapter digest it was sampled with, null for the base); `partial_rollout`: the rows may continue under an
    # in-place reload of their adapter (jaxrl.serve.loop), and return their token versions.
    return_token_versions: bool = False
    partial_rollout: bool = False
    skip_special_tokens: bool = True
    user: Optional[str] = None
    # Accepted only at their neutral values (NEUTRAL).
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    suffix: Optional[str] = None
    prompt_logprobs: Optional[int] = None
    return_tokens_as_token_ids: bool = False


class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    role: str
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    return_tokens_as_token_ids: bool = False


class LoadLoraRequest(_Request):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraRequest(_Request):
    lora_name: str = ""


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[StrictInt]


# field -> its neutral values: anything else is refused (HTTP 400) rather than silently ignored
NEUTRAL = {"presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
           "min_p": (None, 0.0), "min_tokens": (None, 0), "logit_bias": (None, {}), "use_beam_search": (None, False),
           "length_penalty": (None, 1.0), "suffix": (None, ""),
           "tool_choice": (None, "none", "auto"), "continue_final_message": (False,)}


def refuse_unsupported(request: _Request) -> None:
    for field, neutral in NEUTRAL.items():
        if field in type(request).model_fields and getattr(request, field) not in neutral:
            raise ApiError(f"`{field}`={getattr(request, field)!r} is not supported by this server (the jax "
                           f"sampler); leave it out", param=field)
    if request.best_of is not None and request.best_of != request.n:
        raise ApiError(f"best_of={request.best_of} with n={request.n}: this server does not rank candidates; leave "
                       "best_of out (or equal to n)", param="best_of")
    for field in ("return_token_versions", "partial_rollout"):
        if getattr(request, field, False) and getattr(request, "stream", False):
            raise ApiError(f"`{field}` is not supported with stream=true (token versions come with the whole "
                           "answer)", param=field)
    fmt = getattr(request, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        raise ApiError(f"response_format {fmt.get('type')!r} is not supported (no guided decoding); leave it out",
                       param="response_format")


def stop_strings(stop) -> list[str]:
    """The request's `stop` as a list of non-empty strings."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    items = [s for s in items if s]
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    longest = max((len(s) for s in items), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS}", param="stop")
    return items


def template_message(m: ChatMessage) -> dict:
    """A request's message as the chat template takes it: text content, and an assistant turn's tool calls with
    their arguments as objects (the form Qwen's templates iterate over)."""
    out = {"role": m.role, "content": message_text(m.content)}
    if m.tool_calls:
        calls = []
        for k, call in enumerate(m.tool_calls):
            function = call.get("function")
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments", "{}"), (str, dict))):
                raise ApiError(f"messages: tool_calls[{k}] is {call!r}; expected {{\"function\": {{\"name\": str, "
                               "\"arguments\": a JSON string or object}}", param="messages")
            function = dict(function)
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise ApiError("a tool call's function.arguments is not valid JSON", param="messages") from None
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def check_tools(tools: Optional[list]) -> None:
    """A request's `tools` as the chat template and the tool-call parser read them: each {"type": "function",
    "function": {"name": str, "parameters": a JSON schema object}}, whose `properties` is an object and `required`
    a list of names. ApiError (400) naming the tool otherwise: a model's call to a malformed tool would fail later."""
    for k, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)):
            raise ApiError(f"tools[{k}]: each tool must be {{\"type\": \"function\", \"function\": {{\"name\": "
                           "...}}", param="tools")
        params = function.get("parameters", {})
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ApiError(f"tools[{k}] ({function['name']}): parameters must be a JSON schema object, got "
                           f"{type(params).__name__}", param="tools")
        if not isinstance(params.get("properties", {}), dict):
            raise ApiError(f"tools[{k}] ({function['name']}): parameters.properties must be an object (name -> "
                           f"schema), got {type(params['properties']).__name__}", param="tools")
        required = params.get("required", [])
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ApiError(f"tools[{k}] ({function['name']}): parameters.required must be a list of names",
                           param="tools")


def message_text(content) -> str:
    """A chat message's content as text (text parts joined; other part types refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text":
            raise ApiError(f"content parts of type {part.type!r} are not supported (text only)", param="messages")
        parts.append(part.text or "")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Response pieces


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens)}


def sse(payload) -> str:
    """One server-sent event (`data: ...` and a blank line); the stream ends with `data: [DONE]`."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
