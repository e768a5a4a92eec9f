#!/usr/bin/env python3
"""Records llama-server's slot actions, /infill, /v1/models with --alias, a streamed chat and
/v1/responses, for the server's golden tests of those endpoints.

Three runs of the reference `llama-server` (built by reference/build_llama_cpp.sh into
DEST/build/bin, target llama-server):

- SmolLM2-135M-Instruct Q4_1, `-t 2 -c 4096 -np 2 --slot-save-path TMP --alias smollm2-alias`:
  a greedy /completion in slot 0, then POST /slots/0?action=save|erase|restore and the same
  /completion after the restore; the slot errors (bad filename, action, id); GET /v1/models and
  /props (the alias); a streamed greedy /v1/chat/completions; /v1/responses (plain, with
  instructions and message items, streamed).
- the same model without --slot-save-path: a slot action's 501.
- qwen2.5-coder-0.5b-instruct Q4_K_M, `-t 2 -c 4096 -np 1`: greedy /infill without and with
  input_extra.

Writes golden/llama_server_endpoints/<name>.json ({"request": {"method", "path", "body"},
"status", "response"}; a stream: "events", its `data:` payloads, and "event_names", its
`event:` lines) and MANIFEST.md. The tests in crates/server/tests/{slots,infill,openai_extra}.rs
replay the requests against specula's server and compare field by field.

  reference/llama_server_endpoints.py --out golden [--models-dir DIR] [--llama-dest DEST]

Standard library only. Without the binary or a model it prints why and leaves the committed
files alone.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server_common import UPSTREAM, LlamaServer, add_args, http, inputs, sha256_file, sse  # noqa: E402

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
CODER = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ALIAS = "smollm2-alias"
SMOL_ARGS = ["-t", "2", "-c", "4096", "-np", "2"]
CODER_ARGS = ["-t", "2", "-c", "4096", "-np", "1"]

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
GREEDY = {"n_predict": 16, "temperature": 0, "return_tokens": True, "cache_prompt": True, "id_slot": 0}

PREFIX = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
SUFFIX = "\n\nprint(fibonacci(10))\n"
EXTRA = [{"filename": "utils.py", "text": "def memo(f):\n    cache = {}\n    def g(n):\n        if n not in cache:\n            cache[n] = f(n)\n        return cache[n]\n    return g\n"}]
INFILL = {"n_predict": 24, "temperature": 0, "return_tokens": True}


def smol_requests():
    return [
        ("slot_completion", "POST", "/completion", {"prompt": TEXT, **GREEDY}),
        ("slot_save", "POST", "/slots/0?action=save", {"filename": "slot0.bin"}),
        ("slot_erase", "POST", "/slots/0?action=erase", None),
        ("slot_restore", "POST", "/slots/0?action=restore", {"filename": "slot0.bin"}),
        ("slot_restored_completion", "POST", "/completion", {"prompt": TEXT, **GREEDY}),
        ("slot_bad_filename", "POST", "/slots/0?action=save", {"filename": "../escape.bin"}),
        ("slot_bad_action", "POST", "/slots/0?action=explode", None),
        ("slot_bad_id", "POST", "/slots/99?action=erase", None),
        ("slot_bad_id_text", "POST", "/slots/abc?action=erase", None),
        ("slot_restore_missing", "POST", "/slots/1?action=restore", {"filename": "missing.bin"}),
        ("models_alias", "GET", "/v1/models", None),
        ("props_alias", "GET", "/props", None),
        ("chat_stream", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8,
          "temperature": 0, "stream": True}),
        ("responses_text", "POST", "/v1/responses",
         {"input": "What is 2 + 2?", "max_output_tokens": 16, "temperature": 0}),
        ("responses_items", "POST", "/v1/responses",
         {"instructions": "You are a terse assistant.",
          "input": [{"role": "user", "content": "Name a primary color."}],
          "max_output_tokens": 12, "temperature": 0}),
        ("responses_stream", "POST", "/v1/responses",
         {"input": "What is 2 + 2?", "max_output_tokens": 8, "temperature": 0, "stream": True}),
    ]


def coder_requests():
    return [
        ("infill_plain", "POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, **INFILL}),
        ("infill_extra", "POST", "/infill",
         {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "    ", **INFILL}),
        ("infill_missing_prefix", "POST", "/infill", {"input_suffix": SUFFIX, **INFILL}),
    ]


def call(port, method, path, body):
    data = None
    if body is not None:
        data = json.dumps(body).encode()
    elif method == "POST":
        data = b"{}"
    status, text = http(port, method, path, data)
    if isinstance(body, dict) and body.get("stream"):
        events = sse(text)
        names = [n for n, _ in events if n is not None]
        out = {"events": [json.loads(e) if e != "[DONE]" else e for _, e in events]}
        if names:
            out["event_names"] = names
        return status, out
    try:
        return status, {"response": json.loads(text)}
    except json.JSONDecodeError:
        return status, {"response_text": text}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    args = ap.parse_args()
    found = inputs("llama_server_endpoints", args, [SMOL, CODER])
    if found is None:
        return 0
    binary, (smol, coder) = found
    out = args.out / "llama_server_endpoints"
    out.mkdir(parents=True, exist_ok=True)
    names = []

    def record(name, method, path, body, status, got):
        rec = {"request": {"method": method, "path": path, "body": body}, "status": status, **got}
        (out / f"{name}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
        names.append(name)
        print(f"llama_server_endpoints: {name}: {status}")

    with tempfile.TemporaryDirectory() as work:
        saves = Path(work) / "slots"
        saves.mkdir()
        runs = [
            (smol, [*SMOL_ARGS, "--slot-save-path", str(saves), "--alias", ALIAS], smol_requests()),
            (smol, SMOL_ARGS, [("slot_disabled", "POST", "/slots/0?action=save", {"filename": "x.bin"})]),
            (coder, CODER_ARGS, coder_requests()),
        ]
        for model, extra, reqs in runs:
            with LlamaServer("llama_server_endpoints", binary, model, extra, cwd=work) as port:
                for name, method, path, body in reqs:
                    status, got = call(port, method, path, body)
                    record(name, method, path, body, status, got)
    (out / "MANIFEST.md").write_text(f"""# golden/llama_server_endpoints/

Answers of the reference llama-server to fixed requests on slot actions, /infill, /v1/models
with --alias, a streamed chat and /v1/responses; replayed against specula by
`crates/server/tests/{{slots,infill,openai_extra}}.rs`.

| | |
|---|---|
| script | `reference/llama_server_endpoints.py` |
| oracle | llama-server of llama.cpp {UPSTREAM} (vendored by llama-cpp-python 0.3.36, built by `reference/build_llama_cpp.sh`, target `llama-server`) |
| models | `{SMOL}`, sha256 `{sha256_file(smol)}`; `{CODER}`, sha256 `{sha256_file(coder)}` |
| server commands | `llama-server -m {SMOL} {' '.join(SMOL_ARGS)} --slot-save-path DIR --alias {ALIAS}`; the same without `--slot-save-path` / `--alias` (`slot_disabled`); `llama-server -m {CODER} {' '.join(CODER_ARGS)}` (`infill_*`) |
| date | {time.strftime('%Y-%m-%d', time.gmtime())} |
| command | `python reference/llama_server_endpoints.py --out golden --llama-dest /work/llama` |

Files: {', '.join(f'`{n}.json`' for n in names)}. Each holds the request (method, path, body),
the HTTP status and the JSON answer (`response`; `events` for a stream: its `data:` payloads,
and `event_names`, its `event:` lines, where it has them).
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
