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
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
CODER = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
UPSTREAM = "0c1e57098"  # llama.cpp vendored by llama-cpp-python 0.3.36 (see build_llama_cpp.sh)
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


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, method, path, body):
    data = None
    if body is not None:
        data = json.dumps(body).encode()
    elif method == "POST":
        data = b"{}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode()
    if isinstance(body, dict) and body.get("stream"):
        lines = text.split("\n")
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
        out = {"events": [json.loads(e) if e != "[DONE]" else e for e in events]}
        if names:
            out["event_names"] = names
        return status, out
    try:
        return status, {"response": json.loads(text)}
    except json.JSONDecodeError:
        return status, {"response_text": text}


def serve(binary, model, args, work):
    """Starts llama-server; returns (process, port) once healthy."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=work)
    for _ in range(900):
        try:
            if call(port, "GET", "/health", None)[0] == 200:
                return proc, port
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("llama_server_endpoints: llama-server did not become healthy")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the golden/ directory")
    ap.add_argument("--models-dir", type=Path, default=Path.home() / ".cache/specula/models")
    ap.add_argument("--llama-dest", type=Path, default=os.environ.get("SPECULA_LLAMA_DEST", "/work/llama"),
                    help="DEST of reference/build_llama_cpp.sh (llama-server in DEST/build/bin)")
    args = ap.parse_args()
    binary = Path(args.llama_dest) / "build/bin/llama-server"
    smol, coder = args.models_dir / SMOL, args.models_dir / CODER
    if not binary.exists():
        print(f"llama_server_endpoints: skipped, no {binary} (build the llama-server target)")
        return 0
    for m in (smol, coder):
        if not m.exists():
            print(f"llama_server_endpoints: skipped, no {m} (cargo xtask fetch-models)")
            return 0
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
            proc, port = serve(binary, model, extra, work)
            try:
                for name, method, path, body in reqs:
                    status, got = call(port, method, path, body)
                    record(name, method, path, body, status, got)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
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
