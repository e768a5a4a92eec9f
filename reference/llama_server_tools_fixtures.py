#!/usr/bin/env python3
"""Records llama-server's Anthropic Messages and tool-calling answers on Qwen2.5-Coder-0.5B.

Starts the reference `llama-server` (built by reference/build_llama_cpp.sh into DEST/build/bin)
with `--jinja -t 2 -c 4096 -np 1` on qwen2.5-coder-0.5b-instruct Q4_K_M (whose chat template
describes tools and renders `<tool_call>` blocks), sends the requests of REQUESTS (greedy
/v1/messages with and without a system prompt, streamed and not, with tools; count_tokens;
Anthropic errors; chat completions with tools where the model calls one, streamed and not, and
with a tool result in the history; /apply-template with tools) and writes
golden/llama_server_tools/<name>.json, each {"request": {...}, "status", "response"} or, for a
stream, "events": a list of {"event": name or null, "data": payload}. Also MANIFEST.md.
crates/server/tests/anthropic_tools_golden.rs replays them against specula field by field.

  reference/llama_server_tools_fixtures.py --out golden [--models-dir DIR] [--llama-dest DEST]

Standard library only. Without the binary or the model it prints why and leaves the committed
files alone.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server_common import UPSTREAM, LlamaServer, add_args, http, inputs, sha256_file, sse  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ARGS = ["--jinja", "-t", "2", "-c", "4096", "-np", "1"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a given city",
    "input_schema": WEATHER["function"]["parameters"],
}
ASK = "What is the weather like in Paris today?"
HISTORY = [
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"},
    }]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18, \"sky\": \"sunny\"}"},
]
ANTHROPIC_HISTORY = [
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look that up."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris", "unit": "celsius"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "{\"temperature\": 18, \"sky\": \"sunny\"}"}]},
    ]},
]


def requests():
    """(name, path, body) of every fixture (all POST)."""
    g = {"temperature": 0}
    msg = {"model": "qwen", "max_tokens": 32, **g,
           "messages": [{"role": "user", "content": "What is 2 + 2? Answer in one sentence."}]}
    system = {"model": "qwen", "max_tokens": 24, **g,
              "system": [{"type": "text", "text": "You are a pirate. "}, {"type": "text", "text": "Answer briefly."}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello to me."}]}]}
    a_tools = {"model": "qwen", "max_tokens": 64, **g, "tools": [ANTHROPIC_WEATHER],
               "messages": [{"role": "user", "content": ASK}]}
    chat_tools = {"messages": [{"role": "user", "content": ASK}], "tools": [WEATHER],
                  "max_tokens": 64, **g}
    return [
        ("messages_text", "/v1/messages", msg),
        ("messages_stream", "/v1/messages", {**msg, "stream": True}),
        ("messages_system", "/v1/messages", system),
        ("messages_stop", "/v1/messages", {**msg, "stop_sequences": [" 4"]}),
        ("messages_tools", "/v1/messages", a_tools),
        ("messages_tools_stream", "/v1/messages", {**a_tools, "stream": True}),
        ("messages_tools_any", "/v1/messages", {**a_tools, "tool_choice": {"type": "any"}}),
        ("messages_tools_any_stream", "/v1/messages", {**a_tools, "tool_choice": {"type": "any"}, "stream": True}),
        ("messages_tool_result", "/v1/messages",
         {"model": "qwen", "max_tokens": 32, **g, "tools": [ANTHROPIC_WEATHER], "messages": ANTHROPIC_HISTORY}),
        ("count_tokens", "/v1/messages/count_tokens", {"model": "qwen", **system}),
        ("count_tokens_tools", "/v1/messages/count_tokens",
         {"model": "qwen", "tools": [ANTHROPIC_WEATHER], "system": "Be helpful.", "messages": ANTHROPIC_HISTORY}),
        ("messages_error_no_content", "/v1/messages",
         {"model": "qwen", "max_tokens": 8, "messages": [{"role": "user"}]}),
        ("messages_error_context", "/v1/messages",
         {"model": "qwen", "max_tokens": 8, "messages": [{"role": "user", "content": "hello " * 5000}]}),
        ("chat_tools", "/v1/chat/completions", chat_tools),
        ("chat_tools_stream", "/v1/chat/completions", {**chat_tools, "stream": True}),
        ("chat_tools_required", "/v1/chat/completions", {**chat_tools, "tool_choice": "required"}),
        ("chat_tools_required_stream", "/v1/chat/completions",
         {**chat_tools, "tool_choice": "required", "stream": True}),
        ("chat_tool_result", "/v1/chat/completions",
         {"messages": HISTORY, "tools": [WEATHER], "max_tokens": 32, **g}),
        ("chat_tools_none", "/v1/chat/completions", {**chat_tools, "tool_choice": "none"}),
        ("chat_error_tool_choice", "/v1/chat/completions", {**chat_tools, "tool_choice": "sometimes"}),
        ("apply_template_tools", "/apply-template", {"messages": HISTORY, "tools": [WEATHER]}),
    ] + [
        # llama-server's tool-call parser on given text: the answer continues an assistant
        # message that already holds the calls (the model adds nothing: it ends at once).
        (f"parser_{name}", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": ASK}, {"role": "assistant", "content": text}],
          "tools": [WEATHER], "max_tokens": 4, **g})
        for name, text in PARSER_CASES
    ]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
PARSER_CASES = [
    ("one", CALL),
    ("text_before", "Let me check.\n" + CALL),
    ("two", CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome"}}\n</tool_call>'),
]


def request_text(body):
    """The exact request text: key order matters (tool schemas are printed in it)."""
    return json.dumps(body, ensure_ascii=False)


def call(port, method, path, body):
    data = None if body is None else request_text(body).encode()
    status, text = http(port, method, path, data)
    if isinstance(body, dict) and body.get("stream") and status == 200:
        events = [{"event": name, "data": payload if payload == "[DONE]" else json.loads(payload)}
                  for name, payload in sse(text)]
        return status, {"events": events}
    try:
        return status, {"response": json.loads(text)}
    except json.JSONDecodeError:
        return status, {"response_text": text}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    args = ap.parse_args()
    found = inputs("llama_server_tools_fixtures", args, [MODEL])
    if found is None:
        return 0
    binary, (model,) = found
    out = args.out / "llama_server_tools"
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with LlamaServer("llama_server_tools_fixtures", binary, model, ARGS) as port:
        for name, path, body in requests():
            status, got = call(port, "POST", path, body)
            rec = {"request": {"method": "POST", "path": path, "body": body, "raw": request_text(body)},
                   "status": status, **got}
            (out / f"{name}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
            names.append(name)
            print(f"llama_server_tools_fixtures: {name}: {status}")
    shown = ["llama-server", "-m", MODEL, *ARGS]
    (out / "MANIFEST.md").write_text(f"""# golden/llama_server_tools/

Answers of the reference llama-server to Anthropic Messages and tool-calling requests; replayed
against specula by `crates/server/tests/anthropic_tools_golden.rs`.

| | |
|---|---|
| script | `reference/llama_server_tools_fixtures.py` |
| oracle | llama-server of llama.cpp {UPSTREAM} (vendored by llama-cpp-python 0.3.36, built by `reference/build_llama_cpp.sh`, target `llama-server`) |
| model | `{MODEL}`, sha256 `{sha256_file(model)}` |
| server command | `{' '.join(shown)}` |
| date | {time.strftime('%Y-%m-%d', time.gmtime())} |
| command | `python reference/llama_server_tools_fixtures.py --out golden --llama-dest /work/llama` |

Files: {', '.join(f'`{n}.json`' for n in names)}. Each holds the request (method, path, body,
and `raw`: the exact text sent, whose key order the chat template's `tojson` keeps),
the HTTP status and the JSON answer (`response`; `events` for a stream: each SSE event's
`event:` name, or null, and its `data:` payload).
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
