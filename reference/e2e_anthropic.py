#!/usr/bin/env python3
"""End-to-end check of `specula serve` with the official `anthropic` Python client.

Run by `cargo xtask e2e` (which builds the venv, starts the server and passes --base-url, the
server's root, and --api-key; the client sends the key as `x-api-key`); never part of
`cargo xtask ci`. Checks, against a server on the default model:

- `messages.create` with a system prompt answers a `message` with a text block, `end_turn` or
  `max_tokens`, and `usage` with input and output tokens;
- a streamed request (`messages.stream`) yields Anthropic's events and its text equals the
  non-streamed answer to the same greedy request;
- `messages.count_tokens` counts the prompt (more tokens with a longer prompt);
- a request with `tools` is accepted and answers either text or `tool_use` blocks whose input
  is an object (`stop_reason` `tool_use` with them);
- a wrong API key is refused with 401, a request without content with 400.
Exits non-zero with a message on the first failure.
"""

import argparse
import sys

import anthropic


def fail(msg: str) -> None:
    print(f"e2e_anthropic: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a given city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
        "required": ["city"],
    },
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the server's root (no /v1)")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key)
    model = args.model

    # Greedy: `temperature` goes in the body (newer clients no longer take it as an argument).
    greedy = {"extra_body": {"temperature": 0}}
    kw = dict(model=model, max_tokens=32, system="You answer briefly.", **greedy,
              messages=[{"role": "user", "content": "Name three colours of the rainbow."}])
    msg = client.messages.create(**kw)
    if msg.type != "message" or msg.role != "assistant":
        fail(f"not an assistant message: {msg}")
    text = "".join(b.text for b in msg.content if b.type == "text")
    print(f"e2e_anthropic: {msg.stop_reason}, usage {msg.usage}: {text!r}")
    if not text or msg.stop_reason not in ("end_turn", "max_tokens"):
        fail("no text or an unexpected stop_reason")
    if msg.usage.input_tokens <= 0 or msg.usage.output_tokens <= 0:
        fail(f"usage is empty: {msg.usage}")

    events = []
    with client.messages.stream(**kw) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    streamed = "".join(b.text for b in final.content if b.type == "text")
    print(f"e2e_anthropic: streamed {len(events)} events {sorted(set(events))}")
    for need in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"):
        if need not in events:
            fail(f"the stream has no {need} event")
    if streamed != text:
        fail(f"streamed text differs: {streamed!r}")

    short = client.messages.count_tokens(model=model, system="You answer briefly.",
                                         messages=[{"role": "user", "content": "Hi"}])
    long = client.messages.count_tokens(model=model, system="You answer briefly.",
                                        messages=[{"role": "user", "content": "Hi there, how are you today?"}])
    print(f"e2e_anthropic: count_tokens {short.input_tokens} < {long.input_tokens}")
    if not 0 < short.input_tokens < long.input_tokens:
        fail("count_tokens does not grow with the prompt")

    tools = client.messages.create(model=model, max_tokens=64, tools=[WEATHER], **greedy,
                                   messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    uses = [b for b in tools.content if b.type == "tool_use"]
    print(f"e2e_anthropic: with tools: {tools.stop_reason}, {[(u.name, u.input) for u in uses]}")
    if uses and (tools.stop_reason != "tool_use" or not all(isinstance(u.input, dict) for u in uses)):
        fail("tool_use blocks without stop_reason tool_use or with a non-object input")
    if uses:
        follow = client.messages.create(model=model, max_tokens=32, tools=[WEATHER], **greedy, messages=[
            {"role": "user", "content": "What is the weather like in Paris today?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": uses[0].name,
                                               "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "18 degrees and sunny"}]},
        ])
        print(f"e2e_anthropic: after the tool result: {follow.stop_reason}")

    if args.api_key != "none":
        bad = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key + "x")
        try:
            bad.messages.create(**kw)
            fail("a wrong API key was accepted")
        except anthropic.AuthenticationError:
            print("e2e_anthropic: wrong key refused (401)")
    try:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user"}])
        fail("a message without content was accepted")
    except anthropic.BadRequestError as e:
        print(f"e2e_anthropic: bad request refused (400): {e.message}")
    print("e2e_anthropic: OK")


if __name__ == "__main__":
    main()
