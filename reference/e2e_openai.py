#!/usr/bin/env python3
"""End-to-end check of `specula serve` with the official `openai` Python client.

Run by `cargo xtask e2e` (which builds the venv, starts the server and passes --base-url);
never part of `cargo xtask ci`. Checks, against a server on the default model:

- `GET /v1/models` lists one model;
- a streamed chat completion yields text deltas, ends with a finish reason, and its text equals
  the non-streamed answer to the same greedy request (the client parses both shapes);
- a text completion returns `usage` that adds up;
- structured output: a `response_format` JSON schema (strict) with `n=2` gives two choices whose
  content parses and has the schema's keys and types;
- the Responses API (`client.responses.create`): a greedy answer with `output_text` and
  `usage`, and its streamed events (`response.output_text.delta` … `response.completed`)
  giving the same text, raw and through the client's stream helper (`responses.stream`);
- the Responses API with a function tool: a function_call output item (the call forced by a
  GBNF grammar), streamed too, and the call's result sent back as a function_call_output item;
- a chat with `tools` is accepted and answers text or `tool_calls` (each a function with a name
  and JSON arguments, `finish_reason` `tool_calls`), streamed the same way as not;
- a wrong API key is refused with 401 when the server requires one (--api-key).
Exits non-zero with a message on the first failure.
"""

import argparse
import json
import sys

import openai


def fail(msg: str) -> None:
    print(f"e2e: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    models = client.models.list().data
    if len(models) != 1:
        fail(f"expected one model, got {models}")
    model = models[0].id
    print(f"e2e: model {model}")

    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    parts, finish, n_chunks = [], None, 0
    for chunk in stream:
        n_chunks += 1
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.content:
                parts.append(delta.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    streamed = "".join(parts)
    print(f"e2e: streamed {n_chunks} chunks, finish_reason={finish}: {streamed!r}")
    if not streamed or finish not in ("stop", "length"):
        fail("the streamed chat gave no text or no finish reason")

    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=32, temperature=0
    )
    text = full.choices[0].message.content
    if text != streamed:
        fail(f"non-streamed text differs: {text!r}")
    u = full.usage
    if u.total_tokens != u.prompt_tokens + u.completion_tokens or u.completion_tokens == 0:
        fail(f"usage does not add up: {u}")

    comp = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    print(f"e2e: completion {comp.choices[0].text!r}, usage {comp.usage}")
    if comp.usage.completion_tokens == 0:
        fail("the completion generated nothing")

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    structured = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "The largest city of France, as JSON."}],
        max_tokens=64, temperature=0, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    for choice in structured.choices:
        try:
            obj = json.loads(choice.message.content)
        except json.JSONDecodeError as e:
            fail(f"structured output is not JSON: {choice.message.content!r} ({e})")
        if set(obj) != {"city", "population"} or not isinstance(obj["population"], int):
            fail(f"structured output does not follow the schema: {obj}")
    print(f"e2e: structured output {structured.choices[0].message.content} ({len(structured.choices)} choices)")
    resp = client.responses.create(
        model=model, instructions="Answer briefly.", input="Name a primary colour.",
        max_output_tokens=16, temperature=0,
    )
    print(f"e2e: response {resp.id} {resp.status}: {resp.output_text!r}, usage {resp.usage}")
    if resp.object != "response" or resp.status != "completed" or not resp.output_text:
        fail(f"the response is not a completed text answer: {resp}")
    if resp.usage.total_tokens != resp.usage.input_tokens + resp.usage.output_tokens:
        fail(f"response usage does not add up: {resp.usage}")
    kinds, deltas, completed = [], [], None
    events = client.responses.create(
        model=model, instructions="Answer briefly.", input="Name a primary colour.",
        max_output_tokens=16, temperature=0, stream=True,
    )
    for ev in events:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type == "response.completed":
            completed = ev.response
    print(f"e2e: response stream: {len(kinds)} events, {kinds[:4]} ... {kinds[-1:]}")
    if kinds[:1] != ["response.created"] or completed is None:
        fail(f"the response stream is not created ... completed: {kinds}")
    if "".join(deltas) != resp.output_text:
        fail(f"streamed response text differs: {''.join(deltas)!r} vs {resp.output_text!r}")
    with client.responses.stream(
        model=model, instructions="Answer briefly.", input="Name a primary colour.",
        max_output_tokens=16, temperature=0,
    ) as helper:
        final = helper.get_final_response()
    if final.output_text != resp.output_text:
        fail(f"the stream helper's text differs: {final.output_text!r} vs {resp.output_text!r}")
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a given city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    tc = client.chat.completions.create(model=model, messages=ask, tools=[weather], max_tokens=64, temperature=0)
    choice = tc.choices[0]
    calls = choice.message.tool_calls or []
    print(f"e2e: with tools: {choice.finish_reason}, {[(c.function.name, c.function.arguments) for c in calls]}")
    for c in calls:
        if c.type != "function" or not c.id or not isinstance(json.loads(c.function.arguments), dict):
            fail(f"a malformed tool call: {c}")
    if calls and choice.finish_reason != "tool_calls":
        fail(f"tool calls with finish_reason {choice.finish_reason}")
    names, args_text, stream_finish = {}, {}, None
    for chunk in client.chat.completions.create(model=model, messages=ask, tools=[weather], max_tokens=64,
                                                temperature=0, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.function and d.function.name:
                names[d.index] = d.function.name
            if d.function and d.function.arguments:
                args_text[d.index] = args_text.get(d.index, "") + d.function.arguments
        stream_finish = chunk.choices[0].finish_reason or stream_finish
    if [names.get(i) for i in range(len(calls))] != [c.function.name for c in calls] or stream_finish != choice.finish_reason:
        fail(f"streamed tool calls differ: {names} {args_text} {stream_finish}")
    if [json.loads(args_text[i]) for i in range(len(calls))] != [json.loads(c.function.arguments) for c in calls]:
        fail(f"streamed tool-call arguments differ: {args_text}")

    # The Responses API with a function tool: the answer forced (a GBNF grammar, which
    # llama-server also takes) to hold a Hermes call, so the client must read a function_call
    # item, streamed and not; then the call's result goes back as a function_call_output item.
    forced = 'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>"'
    rtool = {"type": "function", **weather["function"]}
    r = client.responses.create(model=model, input="What is the weather like in Paris today?", tools=[rtool],
                                max_output_tokens=64, temperature=0, extra_body={"grammar": forced})
    fcs = [o for o in r.output if o.type == "function_call"]
    print(f"e2e: response with tools: {[(f.name, f.arguments, f.call_id) for f in fcs]}")
    if len(fcs) != 1 or fcs[0].name != "get_weather" or json.loads(fcs[0].arguments) != {"city": "Paris"}:
        fail(f"the response does not hold the function call: {r.output}")
    streamed_args, done_items = "", []
    for ev in client.responses.create(model=model, input="What is the weather like in Paris today?", tools=[rtool],
                                      max_output_tokens=64, temperature=0, stream=True, extra_body={"grammar": forced}):
        if ev.type == "response.function_call_arguments.delta":
            streamed_args += ev.delta
        elif ev.type == "response.output_item.done":
            done_items.append(ev.item)
    if streamed_args != fcs[0].arguments or [i.type for i in done_items] != ["function_call"]:
        fail(f"the streamed function call differs: {streamed_args!r} {done_items}")
    follow = client.responses.create(
        model=model, tools=[rtool], max_output_tokens=16, temperature=0,
        input=[{"role": "user", "content": "What is the weather like in Paris today?"},
               {"type": "function_call", "call_id": fcs[0].call_id, "name": fcs[0].name, "arguments": fcs[0].arguments},
               {"type": "function_call_output", "call_id": fcs[0].call_id, "output": "sunny, 22 C"}],
    )
    print(f"e2e: after the tool result: {follow.output_text!r}")
    if follow.status != "completed":
        fail(f"the follow-up response did not complete: {follow}")

    if args.api_key != "none":
        bad = openai.OpenAI(base_url=args.base_url, api_key=args.api_key + "x")
        try:
            bad.completions.create(model=model, prompt="x", max_tokens=1)
            fail("a wrong API key was accepted")
        except openai.AuthenticationError:
            print("e2e: wrong key refused (401)")
    print("e2e: OK")


if __name__ == "__main__":
    main()
