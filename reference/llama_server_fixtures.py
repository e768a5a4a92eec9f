#!/usr/bin/env python3
"""Records llama-server's answers to fixed requests on SmolLM2-135M, for the server's golden test.

Starts the reference `llama-server` (built by reference/build_llama_cpp.sh into DEST/build/bin,
target llama-server) on SmolLM2-135M-Instruct Q4_1 with `-t 2 -c 2048 -np 1`, sends the requests
of REQUESTS (greedy /completion with a text and with a token-id prompt, streamed and not,
/apply-template, /tokenize, /props, and the error cases: context exceeded, bad JSON, missing
prompt, unknown endpoint), and writes golden/llama_server/<name>.json, each holding
{"request": {"method", "path", "body"}, "status", "response"} (streamed answers: "events", the
list of `data:` payloads), plus golden/llama_server/MANIFEST.md (llama.cpp commit, binary,
model sha256, command). crates/server/tests/llama_server_golden.rs replays the same requests
against specula's server and compares field by field.

  reference/llama_server_fixtures.py --out golden [--models-dir DIR] [--llama-dest DEST]

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

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARGS = ["-t", "2", "-c", "2048", "-np", "1"]

TEXT = "The capital of France is"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def requests(ids):
    """(name, method, path, body) of every fixture; `ids` is TEXT tokenized with BOS."""
    greedy = {"n_predict": 24, "temperature": 0, "return_tokens": True, "seed": 42}
    return [
        ("completion_text", "POST", "/completion", {"prompt": TEXT, **greedy}),
        ("completion_ids", "POST", "/completion", {"prompt": ids, **greedy}),
        ("completion_stream", "POST", "/completion", {"prompt": TEXT, **greedy, "stream": True}),
        ("completions_plural", "POST", "/completions", {"prompt": TEXT, **greedy, "n_predict": 8}),
        ("apply_template", "POST", "/apply-template", {"messages": MESSAGES}),
        ("tokenize", "POST", "/tokenize", {"content": "Hello, world! How are you?"}),
        ("tokenize_special", "POST", "/tokenize", {"content": TEXT, "add_special": True}),
        ("props", "GET", "/props", None),
        ("error_context", "POST", "/completion", {"prompt": [28] * 2100, "n_predict": 4}),
        ("error_bad_json", "POST", "/completion", "{not json"),
        ("error_missing_prompt", "POST", "/completion", {"n_predict": 4}),
        ("error_not_found", "GET", "/no-such-endpoint", None),
    ]


API_KEY = "fixture-key"


def key_requests():
    """Fixtures of a second run with `--api-key API_KEY`: (name, method, path, body, headers)."""
    return [
        ("auth_missing", "GET", "/props", None, {}),
        ("auth_wrong", "POST", "/completion", {"prompt": TEXT, "n_predict": 1},
         {"Authorization": "Bearer wrong"}),
        ("auth_health_public", "GET", "/health", None, {}),
    ]


def call(port, method, path, body, headers=None):
    data = None
    if body is not None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    status, text = http(port, method, path, data, headers, timeout=120)
    if isinstance(body, dict) and body.get("stream"):
        events = [e for _, e in sse(text)]
        return status, {"events": [json.loads(e) if e != "[DONE]" else e for e in events]}
    try:
        return status, {"response": json.loads(text)}
    except json.JSONDecodeError:
        return status, {"response_text": text}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    args = ap.parse_args()
    found = inputs("llama_server_fixtures", args, [MODEL])
    if found is None:
        return 0
    binary, (model,) = found
    out = args.out / "llama_server"
    out.mkdir(parents=True, exist_ok=True)
    names = []

    def record(name, method, path, body, status, got, headers=None):
        rec = {"request": {"method": method, "path": path, "body": body}, "status": status, **got}
        if headers:
            rec["request"]["headers"] = headers
        (out / f"{name}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
        names.append(name)
        print(f"llama_server_fixtures: {name}: {status}")

    for extra in ([], ["--api-key", API_KEY]):
        with LlamaServer("llama_server_fixtures", binary, model, [*ARGS, *extra]) as port:
            if extra:
                for name, method, path, body, headers in key_requests():
                    status, got = call(port, method, path, body, headers)
                    record(name, method, path, body, status, got, headers)
                continue
            status, tok = call(port, "POST", "/tokenize", {"content": TEXT, "add_special": True})
            assert status == 200, tok
            ids = tok["response"]["tokens"]
            for name, method, path, body in requests(ids):
                status, got = call(port, method, path, body)
                record(name, method, path, body, status, got)
    shown = ["llama-server", "-m", MODEL, *ARGS]
    (out / "MANIFEST.md").write_text(f"""# golden/llama_server/

Answers of the reference llama-server to fixed requests; replayed against specula by
`crates/server/tests/llama_server_golden.rs`.

| | |
|---|---|
| script | `reference/llama_server_fixtures.py` |
| oracle | llama-server of llama.cpp {UPSTREAM} (vendored by llama-cpp-python 0.3.36, built by `reference/build_llama_cpp.sh`, target `llama-server`) |
| model | `{MODEL}`, sha256 `{sha256_file(model)}` |
| server command | `{' '.join(shown)}` (the `auth_*` files: the same with `--api-key {API_KEY}`) |
| date | {time.strftime('%Y-%m-%d', time.gmtime())} |
| command | `python reference/llama_server_fixtures.py --out golden --llama-dest /work/llama` |

Files: {', '.join(f'`{n}.json`' for n in names)}. Each holds the request (method, path, body),
the HTTP status and the JSON answer (`response`; `events` for a stream: its `data:` payloads).
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
