"""Tool calls (issue 39, serving for agents): Qwen3.5's `<tool_call>` blocks read out of a completion as vLLM's
qwen3 parser reads them (typed by the tool's schema), returned as OpenAI `tool_calls` with finish_reason
"tool_calls", plain and streamed; a malformed call returned as text with its own finish reason, never a 500; and a
request with `tools` (and a history holding an assistant tool call and a tool message) answered by a real
`launchers.serve` through the official `openai` SDK."""

import json

import pytest

from serve_fixture import Served, build_base

TOOLS = [{"type": "function", "function": {"name": "run_python", "description": "Run code",
                                           "parameters": {"type": "object", "properties": {
                                               "code": {"type": "string"}, "timeout": {"type": "integer"}}}}}]
CALL = ("<tool_call>\n<function=run_python>\n<parameter=code>\nprint(1 + 1)\n</parameter>\n"
        "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>")


def test_well_formed_calls_are_parsed_with_the_schemas_types():
    from jaxrl.data.tool_calls import parse_tool_calls
    content, calls = parse_tool_calls("Let me run it.\n" + CALL + "\n" + CALL.replace("1 + 1", "2"), TOOLS)
    assert content == "Let me run it.\n" and [c.name for c in calls] == ["run_python", "run_python"]
    assert calls[0].arguments == {"code": "print(1 + 1)", "timeout": 5}  # integer by the schema, code kept as text
    assert calls[1].arguments["code"] == "print(2)"
    assert json.loads(calls[0].openai("call-1")["function"]["arguments"]) == {"code": "print(1 + 1)", "timeout": 5}
    assert parse_tool_calls(CALL, TOOLS)[0] is None  # no text before the call: content None, as vLLM


@pytest.mark.parametrize("text", [
    CALL.replace("</tool_call>", ""),  # unclosed
    CALL + " and then some text",  # text after the calls
    CALL.replace("run_python", "rm_rf"),  # a tool the request did not offer
    "<tool_call>\n{\"name\": \"run_python\"}\n</tool_call>",  # no <function=...>
    "no call at all"])
def test_a_malformed_call_is_plain_text(text):
    from jaxrl.data.tool_calls import parse_tool_calls
    assert parse_tool_calls(text, TOOLS) == (text, None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_calls")
    served = Served(root, build_base(root / "base"), "--max_prompt_len=256", "--prompt_buckets=256",
                    "--generation_buckets=16", "--batch_size=4")
    yield served
    served.stop()


def _handlers(server_dir):
    """The server's own Handlers over a loop that is never started (no model call: the rows are given)."""
    from jaxrl.serve.app import CompletionServer
    return CompletionServer(server_dir, dtype="float32", batch_size=4, start=False).handlers


@pytest.mark.parametrize("stream", [False, True])
def test_the_chat_answer_of_a_row_that_called_a_tool(tmp_path, stream):
    from jaxrl.generation.stopping import Finished
    from jaxrl.serve.handlers import Plan
    from jaxrl.serve.protocol import ChatCompletionRequest
    handlers = _handlers(build_base(tmp_path / "base"))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "2?"}], tools=TOOLS, stream=stream)
    plan = Plan(handlers.registry.served(None), [[1, 2]], [None], None, [])
    rows = [Finished([], [], "Running.\n" + CALL, "stop", None), Finished([], [], CALL[:-3], "length", None)]
    body = handlers._chat_body(req, plan, rows, None)
    called, broken = body["choices"]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] == "Running.\n"
    (call,) = called["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "run_python"
    assert json.loads(call["function"]["arguments"]) == {"code": "print(1 + 1)", "timeout": 5}
    assert broken["finish_reason"] == "length" and broken["message"] == {"role": "assistant", "content": CALL[:-3]}
    if stream:
        chunks = [json.loads(c[len("data: "):]) for c in handlers._stream_chat(req, body, rows) if "[DONE]" not in c]
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert any("tool_calls" in d and d["tool_calls"][0]["function"]["name"] == "run_python" for d in deltas)
        finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
        assert "tool_calls" in finishes and "length" in finishes


def test_the_sdk_sends_tools_and_a_tool_conversation(server):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    history = [{"role": "user", "content": "Add 1 and 1."},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call-1", "type": "function",
                   "function": {"name": "run_python", "arguments": json.dumps({"code": "print(1 + 1)"})}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": "2"}]
    out = client.chat.completions.create(model=_served_name(server), messages=history, tools=TOOLS, max_tokens=8,
                                         temperature=0, seed=1)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError):  # forcing a call needs guided decoding, which this server lacks
        client.chat.completions.create(model=_served_name(server), messages=history[:1], tools=TOOLS, max_tokens=4,
                                       tool_choice="required")


def _served_name(server) -> str:
    from jaxrl.backends.openai_client import http_json
    return http_json("GET", server.url + "/v1/models")[1]["data"][0]["id"]


def test_a_stream_sends_text_as_the_rows_are_sampled_and_equals_the_plain_answer(server):
    """Token by token (round by round): a 64-token completion at 16 steps a round arrives in several text chunks
    before its finish chunk (counted, not timed; the first chunk's share of the wall time is printed), and the
    chunks join to the plain answer, with a stop string cut where the plain answer cuts it."""
    import time

    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    name = _served_name(server)
    kwargs = dict(model=name, prompt="The quick brown fox", max_tokens=64, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0]
    t0 = time.perf_counter()
    arrivals, texts = [], []
    for ch in client.completions.create(**kwargs, stream=True):
        if ch.choices and ch.choices[0].text:
            arrivals.append(time.perf_counter() - t0)
            texts.append(ch.choices[0].text)
    total = time.perf_counter() - t0
    print(f"first chunk at {arrivals[0]:.2f} s of {total:.2f} s; {len(texts)} text chunks")
    assert "".join(texts) == plain.text and len(texts) >= 3, texts  # 64 tokens: >= 4 rounds of <= 16 steps
    stop = plain.text[10:13]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kwargs, stop=[stop], stream=True)
                       if ch.choices)
    assert streamed == cut.text and stop not in streamed
    chat = dict(model=name, messages=[{"role": "user", "content": "Say hi"}], max_tokens=32, seed=3,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**chat, stream=True)
             if ch.choices]
    assert "".join(parts) == whole and sum(1 for p in parts if p) >= 2


def test_malformed_tool_calls_and_tools_are_refused_naming_them(server):
    """Reproduction (2e1e1a6): a message with `"tool_calls": [{"function": "abc"}]` was a 500 on chat completions
    and on /tokenize; a tool whose `parameters.properties` is a list was accepted (a model's call to it would have
    been a 500). Each is now a 400 in OpenAI's shape naming the field, and the server answers the next request."""
    from jaxrl.backends.openai_client import http_json
    name = _served_name(server)
    bad_call = [{"role": "user", "content": "1?"}, {"role": "assistant", "content": None,
                                                   "tool_calls": [{"function": "abc"}]}]
    for path, body in (("/v1/chat/completions", {"model": name, "messages": bad_call, "max_tokens": 2}),
                       ("/tokenize", {"model": name, "messages": bad_call})):
        status, out = http_json("POST", server.url + path, body)
        assert status == 400 and out["error"]["param"] == "messages", (path, status, out)
        assert "tool_calls[0]" in out["error"]["message"]
    listed = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": ["x", "y"]}}}]
    status, out = http_json("POST", server.url + "/v1/chat/completions",
                            {"model": name, "messages": bad_call[:1], "tools": listed, "max_tokens": 2})
    assert status == 400 and out["error"]["param"] == "tools" and "properties must be an object" in \
        out["error"]["message"]
    status, out = http_json("POST", server.url + "/v1/chat/completions",
                            {"model": name, "messages": bad_call[:1], "tools": TOOLS, "max_tokens": 2})
    assert status == 200, out
