#!/usr/bin/env python3
"""Records llama-server's constrained answers (GBNF `grammar`, `json_schema`) on SmolLM2-135M.

Starts the reference `llama-server` (llama.cpp's own GBNF sampler; its `json_schema` goes
through json-schema-to-grammar to GBNF) on SmolLM2-135M-Instruct Q4_1 with
`-t 2 -c 2048 -np 1`, sends greedy /completion requests with the grammars and schemas of
REQUESTS, and writes golden/llama_server_grammar/<name>.json ({"request", "status",
"response"}) and its MANIFEST.md. crates/server/tests/llama_server_grammar.rs replays them
against specula (llguidance through the GBNF bridge) and compares `content` and `tokens`.

  reference/llama_server_grammar_fixtures.py --out golden [--models-dir DIR] [--llama-dest DEST]

Standard library only; the server and HTTP helpers are llama_server_common.py's
(requests sent as llama_server_fixtures.py sends them). Without the
binary or the model it prints why and leaves the committed files alone.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server_common import UPSTREAM, LlamaServer, add_args, inputs, sha256_file  # noqa: E402
from llama_server_fixtures import ARGS, MODEL, call  # noqa: E402

ARITH = r'''root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= [1-9] [0-9]{0,2} | "(" inner ")"
inner  ::= [0-9] ("+" [0-9]){0,2}
'''

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def requests():
    """(name, body) of every fixture: greedy /completion with a grammar or a schema."""
    g = {"n_predict": 48, "temperature": 0, "return_tokens": True, "seed": 42}
    return [
        ("grammar_yes_no", {"prompt": CHAT.format(q="Is Paris in France?"), **g,
                            "grammar": 'root ::= ("yes" | "no")'}),
        ("grammar_yes_no_capital", {"prompt": CHAT.format(q="Is the sun cold?"), **g,
                                    "grammar": 'root ::= ("Yes" | "No") "."'}),
        ("grammar_arith", {"prompt": CHAT.format(q="Write an arithmetic expression."), **g,
                           "grammar": ARITH}),
        ("grammar_arith_text", {"prompt": "12 times 4 plus 3 is written as ", **g, "grammar": ARITH}),
        ("grammar_words", {"prompt": CHAT.format(q="Name three colours."), **g,
                           "grammar": 'root ::= word (", " word){2}\nword ::= [a-z]{3,8}'}),
        ("grammar_digits", {"prompt": "The year the Berlin wall fell: ", **g,
                            "grammar": "root ::= [0-9]{4}"}),
        ("json_schema_person", {"prompt": CHAT.format(q="Give a person as JSON."), **g,
                                "json_schema": {"type": "object", "properties": {
                                    "name": {"type": "string", "maxLength": 12},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                                    "required": ["name", "age"], "additionalProperties": False}}),
        ("json_schema_enum", {"prompt": CHAT.format(q="What colour is the sky?"), **g,
                              "json_schema": {"enum": ["red", "green", "blue"]}}),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    args = ap.parse_args()
    found = inputs("llama_server_grammar_fixtures", args, [MODEL])
    if found is None:
        return 0
    binary, (model,) = found
    out = args.out / "llama_server_grammar"
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with LlamaServer("llama_server_grammar_fixtures", binary, model, ARGS) as port:
        for name, body in requests():
            status, got = call(port, "POST", "/completion", body)
            rec = {"request": {"method": "POST", "path": "/completion", "body": body}, "status": status, **got}
            (out / f"{name}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
            names.append(name)
            print(f"llama_server_grammar_fixtures: {name}: {status} {got.get('response', {}).get('content')!r}")
    shown = ["llama-server", "-m", MODEL, *ARGS]
    (out / "MANIFEST.md").write_text(f"""# golden/llama_server_grammar/

Greedy answers of the reference llama-server (its own GBNF sampler; `json_schema` converted by
its json-schema-to-grammar) to /completion requests with a `grammar` or a `json_schema`;
replayed against specula by `crates/server/tests/llama_server_grammar.rs`.

| | |
|---|---|
| script | `reference/llama_server_grammar_fixtures.py` |
| oracle | llama-server of llama.cpp {UPSTREAM} (vendored by llama-cpp-python 0.3.36, built by `reference/build_llama_cpp.sh`, target `llama-server`) |
| model | `{MODEL}`, sha256 `{sha256_file(model)}` |
| server command | `{' '.join(shown)}` |
| date | {time.strftime('%Y-%m-%d', time.gmtime())} |
| command | `python reference/llama_server_grammar_fixtures.py --out golden --llama-dest /work/llama` |

Files: {', '.join(f'`{n}.json`' for n in names)}. Each holds the request (method, path, body),
the HTTP status and the JSON answer (`response`).
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
