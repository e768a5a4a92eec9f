#!/usr/bin/env python3
"""Tokenizer goldens for specula-tokenizer, produced by llama.cpp's own tokenizer.

Writes OUT/tokenizer/<model>.json for every model of the manifest found in --models-dir
(smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m). Each file holds:

  vocab       llama.cpp's view of the vocabulary after loading: type, pre-tokenizer name,
              n_tokens, the special ids (bos, eos, eot, eom, unk, sep, pad, mask, nl, fim_*),
              add_bos / add_eos, the end-of-generation ids (every id with llama_vocab_is_eog),
              a histogram and sha256 of every token's attribute bits (llama_vocab_get_attr, as
              little-endian u32), and the sha256 of every token's piece
              (llama_token_to_piece, special=true and special=false; see `pieces_sha256`).
  strings     for each tricky string (CRLF, tabs, space runs, digits, emoji, CJK, accents,
              literal special tokens, the empty string, ...) and each mode
              (add_special, parse_special) in MODES: the token ids of llama_tokenize, and (for
              the parse_special modes) the text of llama_detokenize of those ids with
              (remove_special=false, unparse_special=true) and (remove_special=true,
              unparse_special=false).
  stdlib      for each file of STDLIB_FILES (CPython 3.11.7's standard library, read as UTF-8):
              the sha256 and size of its text, and for add_special=true with parse_special
              true and false: the number of ids and the sha256 of the ids (little-endian i32,
              concatenated), not the ids themselves, so the golden stays small.
  pieces      token_to_piece of a few ids, special=true and false, for readable diffs.
  chat        the model's `tokenizer.chat_template` rendered by jinja2 (the renderer the
              templates are written for, in the environment Hugging Face's
              apply_chat_template builds: trim_blocks, lstrip_blocks, loopcontrols,
              raise_exception, strftime_now, tojson = json.dumps(ensure_ascii=False)) for two
              conversations with and without add_generation_prompt and one with tool
              definitions and a tool call, with bos_token/eos_token set to the texts of the
              bos/eos ids (messages and tools stored as JSON text to keep their key order);
              plus what llama.cpp's own llama_chat_apply_template (pattern-matched, not
              Jinja) makes of the plain conversations, for comparison only.

And OUT/tokenizer/pretokenizers.json, independent of any model: every `tokenizer.ggml.pre`
name of llama.cpp's `llama_vocab::impl::load` with the pre-tokenizer type and flags it sets,
and for every type the regexes and byte-encoding flag of `llm_tokenizer_bpe` — both parsed
from the vendored `src/llama-vocab.cpp` — with the words llama.cpp's own
`unicode_regex_split` (called through a small C++ shim compiled here with g++ and linked
against libllama.so; byte_encode=false, empty words dropped) cuts PRE_STRINGS into, as byte
lengths. Without g++ or the llama.cpp sources that file is kept as it is.

Oracle: llama.cpp as vendored by llama-cpp-python 0.3.36 (upstream ggml-org/llama.cpp
0c1e57098), libllama.so built by reference/build_llama_cpp.sh, called through the sdist's
ctypes bindings (vocab_only=True). The bindings are pure Python (they need typing_extensions,
diskcache and jinja2, pinned in reference/requirements.txt); point at a build of
reference/build_llama_cpp.sh DEST with

  reference/tokenizer_golden.py --out golden --models-dir DIR --llama-dest DEST
  SPECULA_LLAMA_DEST=DEST cargo xtask golden          # the same, for every reference script

--llama-dest puts DEST/llama_cpp_python-0.3.36 on sys.path and sets LLAMA_CPP_LIB_PATH to
DEST/build/bin (an environment with PYTHONPATH and LLAMA_CPP_LIB_PATH already set works too).
Without an importable llama_cpp the script prints why and exits 0, leaving the committed
goldens as they are, so `cargo xtask golden` works everywhere.

Hashes: sha256 of ids = sha256(b"".join(struct.pack("<i", id) for id in ids)); sha256 of
pieces = sha256 over every id in order of (u32 little-endian byte length, piece bytes).
"""

import argparse
import ctypes
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import struct
import sys
from pathlib import Path

MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
}

# (add_special, parse_special)
MODES = [(True, True), (True, False), (False, True)]

STRINGS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r\n\r\n",
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello world   ",
    "hello\tworld\r\nnext line\r\n",
    "   leading spaces",
    "\t\tindented\n\t\t\tmore\n",
    "line1\r\nline2\rline3\n",
    "1234567",
    "3.14159 and 1,000,000 and 0x1F and 007",
    "a1b2c3 x86_64 v2.0.1",
    "I'm can't we'll they've she'd it's",
    "I'M CAN'T WE'LL THEY'VE SHE'D IT'S",
    "don't\nDON'T 's 'S 'Re",
    "emoji \U0001F642\U0001F44D\U0001F3FD \U0001F1EB\U0001F1F7 \U0001F468\u200d\U0001F469\u200d\U0001F467",
    "\U0001F642\U0001F642\U0001F642\U0001F642\U0001F642",
    "中文字符测试，你好世界。",
    "日本語のテキストです。カタカナ",
    "한국어 텍스트",
    "café naïve résumé Ångström",
    "e\u0301 combining a\u0308 o\u0302",
    "Ελληνικά Русский العربية עברית हिन्दी ไทย",
    "①②③ ½ ²³ Ⅻ ٣٤٥ १२३ ０１２",
    "$100.00 €50 £30 ¥1000 ≥ ≤ → ∑",
    "\u00a0nbsp\u2003emspace\u3000ideographic\u200bzero-width",
    "\u0085next-line \x0b vertical tab \x0c form feed",
    "control \x01\x02\x7f chars",
    "Ġ Ċ ▁ byte-level look-alikes",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ ligature",
    "http://example.com/path?q=1&r=2#frag",
    "x = [1, 2, 3]  # comment\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "                ",
    "\n" * 35,
    " " * 40 + "x",
    "a" * 100,
    "===========================================",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    " <|im_start|> spaces around <|im_end|> ",
    "<|im_start|><|im_start|>",
    "<|im_start",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<tool_call>{\"name\": \"x\"}</tool_call>",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk>",
    "<s>text</s>",
    "<unused0><unused6241>",
    "[multimodal] <start_of_image>",
    "<table><tr><td>x</td></tr></table>",
    "<repo_name>specula<file_sep>a.py",
]

PRE_STRINGS = [
    "Hello World, hello world!",
    "HelloWorld camelCase XMLHttpRequest",
    "  leading\tand  trailing  ",
    "line1\r\nline2\n\n  indented\n",
    "1234567 3.14 1,000,000 x86_64",
    "I'm can't WE'LL they've 's",
    "emoji \U0001F642\U0001F44D\U0001F3FD done",
    "中文字符测试，你好世界。",
    "日本語のテキスト カタカナ ﾊﾝｶｸ",
    "한국어 텍스트",
    "café naïve e\u0301 a\u0308",
    "Ελληνικά Русский العربية עברית हिन्दी ไทย",
    "①②③ ½ ²³ Ⅻ ٣٤٥ १२३ ０１２",
    "$100.00 €50 ≥ → ∑ (a+b)*c/d",
    "\u00a0nbsp\u2003em\u3000ideo\u200bzw \u0085nel",
    "<sentinel:12> IMGIMGABZ",
    "def f(x):\n    return x**2  # square\n",
    "http://example.com/a?b=1&c=2",
    "!!! ... ??? --- ___ ***",
]

STDLIB_FILES = [
    "json/decoder.py",
    "textwrap.py",
    "heapq.py",
    "difflib.py",
    "string.py",
    "html/parser.py",
    "html/entities.py",
    "re/_casefix.py",
    "test/test_unicode.py",
    "test/test_email/test_headerregistry.py",
    "test/test_traceback.py",
    "test/tokenizedata/coding20731.py",
    "lib2to3/tests/data/crlf.py",
    "email/_header_value_parser.py",
    "calendar.py",
    "this.py",
    "encodings/cp1252.py",
    "locale.py",
    "argparse.py",
    "asyncio/base_events.py",
]

# (messages, tools); the last one exercises tool definitions and calls (tojson, key order).
CONVERSATIONS = [
    ([
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ], None),
    ([
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ], None),
    ([
        {"role": "user", "content": "Weather in <Paris> & 'Rome'?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 20.5}"},
    ], [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Weather <now>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    ]),
]


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def text_or_bytes(b: bytes):
    """A string when `b` is valid UTF-8, else {"bytes": [...]} (a lone byte token, or a
    detokenized sequence that ends inside a UTF-8 sequence)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"bytes": list(b)}


def dump(obj, indent=0) -> str:
    """JSON with one line per leaf record (an object without nested lists of objects), so
    that id lists do not take one line per id and diffs stay readable."""
    pad = " " * indent
    if isinstance(obj, dict) and any(isinstance(v, (dict, list)) and _has_records(v) for v in obj.values()):
        items = [f'{pad} {json.dumps(k)}: {dump(v, indent + 1).lstrip()}' for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and _has_records(obj):
        items = [dump(v, indent + 1) for v in obj]
        return pad + "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return pad + json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def _has_records(v) -> bool:
    if isinstance(v, list):
        return any(isinstance(x, dict) for x in v)
    if isinstance(v, dict):
        return any(isinstance(x, (dict, list)) and _has_records(x) for x in v.values()) or len(v) > 8
    return False


def ids_sha256(ids) -> str:
    return sha256(b"".join(struct.pack("<i", i) for i in ids))


class Llama:
    """The few llama.cpp calls the goldens need, on a vocab-only model."""

    def __init__(self, lib, path: Path):
        self.lib = lib
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_tokens = lib.llama_vocab_n_tokens(self.vocab)

    def close(self):
        self.lib.llama_model_free(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool):
        b = text.encode("utf-8")
        cap = len(b) + 16
        buf = (ctypes.c_int32 * cap)()
        n = self.lib.llama_tokenize(self.vocab, b, len(b), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = self.lib.llama_tokenize(self.vocab, b, len(b), buf, cap, add_special, parse_special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, ids, remove_special: bool, unparse_special: bool) -> bytes:
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        cap = 64 + 8 * len(ids)
        buf = ctypes.create_string_buffer(cap)
        n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n
            buf = ctypes.create_string_buffer(cap)
            n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        return buf.raw[:n]

    def piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def text(self, token: int) -> str:
        return self.lib.llama_vocab_get_text(self.vocab, token).decode("utf-8")

    def meta(self, key: str):
        buf = ctypes.create_string_buffer(1 << 20)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8")

    def chat_apply_template(self, template: str, messages, add_ass: bool):
        msgs = (self.lib.llama_chat_message * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            role, content = m["role"].encode(), m["content"].encode()
            keep += [role, content]
            msgs[i].role = role
            msgs[i].content = content
        cap = 1 << 16
        buf = ctypes.create_string_buffer(cap)
        n = self.lib.llama_chat_apply_template(template.encode(), msgs, len(messages), add_ass, buf, cap)
        return None if n < 0 else buf.raw[:n].decode("utf-8")


def special_ids(lib, llm: Llama) -> dict:
    v = llm.vocab
    out = {}
    for name in ["bos", "eos", "eot", "sep", "nl", "pad", "mask",
                 "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"]:
        out[name] = getattr(lib, f"llama_vocab_{name}")(v)
    return out


def vocab_info(lib, llm: Llama) -> dict:
    n = llm.n_tokens
    attrs = [lib.llama_vocab_get_attr(llm.vocab, i) for i in range(n)]
    hist = {}
    for a in attrs:
        hist[str(a)] = hist.get(str(a), 0) + 1
    pieces = {}
    for special in (True, False):
        h = hashlib.sha256()
        for i in range(n):
            p = llm.piece(i, special)
            h.update(struct.pack("<I", len(p)))
            h.update(p)
        pieces["special" if special else "plain"] = h.hexdigest()
    vocab_types = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}
    return {
        "type": vocab_types.get(lib.llama_vocab_type(llm.vocab), "unknown"),
        "model": llm.meta("tokenizer.ggml.model"),
        "pre": llm.meta("tokenizer.ggml.pre"),
        "n_tokens": n,
        "special": special_ids(lib, llm),
        "add_bos": bool(lib.llama_vocab_get_add_bos(llm.vocab)),
        "add_eos": bool(lib.llama_vocab_get_add_eos(llm.vocab)),
        "eog": [i for i in range(n) if lib.llama_vocab_is_eog(llm.vocab, i)],
        "attr_histogram": hist,
        "attr_sha256": sha256(b"".join(struct.pack("<I", a) for a in attrs)),
        "pieces_sha256": pieces,
    }


def render_jinja(template: str, messages, tools, add_generation_prompt: bool, bos: str, eos: str) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        # Fixed date so that the golden is reproducible; the Rust side is given the same.
        return datetime.datetime(2026, 1, 2, 3, 4, 5).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    extra = {} if tools is None else {"tools": tools}
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            bos_token=bos, eos_token=eos, **extra)


def golden_for(lib, name: str, path: Path, stdlib: Path) -> dict:
    llm = Llama(lib, path)
    try:
        info = vocab_info(lib, llm)
        strings = []
        for text in STRINGS:
            entry = {"text": text, "modes": []}
            for add_special, parse_special in MODES:
                ids = llm.tokenize(text, add_special, parse_special)
                mode = {"add_special": add_special, "parse_special": parse_special, "ids": ids}
                if parse_special:
                    mode["detok_unparse"] = text_or_bytes(llm.detokenize(ids, False, True))
                    mode["detok_remove"] = text_or_bytes(llm.detokenize(ids, True, False))
                entry["modes"].append(mode)
            strings.append(entry)

        files = []
        for rel in STDLIB_FILES:
            raw = (stdlib / rel).read_bytes()
            text = raw.decode("utf-8")
            entry = {"path": rel, "bytes": len(raw), "text_sha256": sha256(raw), "modes": []}
            for parse_special in (True, False):
                ids = llm.tokenize(text, True, parse_special)
                entry["modes"].append({
                    "add_special": True,
                    "parse_special": parse_special,
                    "n_ids": len(ids),
                    "ids_sha256": ids_sha256(ids),
                })
            files.append(entry)

        sample = sorted(set(list(range(0, 8)) + list(range(104, 112)) + list(range(236, 244))
                            + [info["special"][k] for k in info["special"] if info["special"][k] >= 0]
                            + [llm.n_tokens - 1 - i for i in range(4)]
                            + [(i * 7919) % llm.n_tokens for i in range(16)]))
        pieces = [{"id": i, "text": llm.text(i), "special": text_or_bytes(llm.piece(i, True)),
                   "plain": text_or_bytes(llm.piece(i, False))} for i in sample]

        template = llm.meta("tokenizer.chat_template")
        chat = None
        if template is not None:
            bos = llm.text(info["special"]["bos"]) if info["special"]["bos"] >= 0 else ""
            eos = llm.text(info["special"]["eos"]) if info["special"]["eos"] >= 0 else ""
            renders = []
            for messages, tools in CONVERSATIONS:
                for agp in (True, False):
                    if tools is not None and not agp:
                        continue
                    r = {
                        # JSON text, so that readers keep the key order (tojson prints it).
                        "messages_json": json.dumps(messages, ensure_ascii=False),
                        "tools_json": None if tools is None else json.dumps(tools, ensure_ascii=False),
                        "add_generation_prompt": agp,
                        "text": render_jinja(template, messages, tools, agp, bos, eos),
                    }
                    if tools is None:
                        r["llama_chat_apply_template"] = llm.chat_apply_template(template, messages, agp)
                    renders.append(r)
            chat = {
                "template_sha256": sha256(template.encode()),
                "bos_token": bos,
                "eos_token": eos,
                "renderer": f"jinja2 {importlib.metadata.version('jinja2')} (HF apply_chat_template environment)",
                "renders": renders,
            }

        return {
            "model": name,
            "file": path.name,
            "producer": PRODUCER,
            "hashes": "ids: sha256 of little-endian i32s; pieces: sha256 of (u32 LE length, bytes) per id",
            "vocab": info,
            "strings": strings,
            "stdlib": {"root": str(stdlib), "files": files},
            "pieces": pieces,
            "chat": chat,
        }
    finally:
        llm.close()


SHIM = r"""
#include <climits>
#include <cstddef>
#include <string>
#include <vector>

std::vector<std::string> unicode_regex_split(const std::string & text,
                                             const std::vector<std::string> & regex_exprs,
                                             bool byte_encode);

extern "C" int specula_split(const char * text, size_t len, const char ** exprs, size_t n,
                             size_t * lens, size_t cap) {
    try {
        std::vector<std::string> ex;
        for (size_t i = 0; i < n; ++i) ex.emplace_back(exprs[i]);
        auto words = unicode_regex_split(std::string(text, len), ex, false);
        if (words.size() > cap) return -(int) words.size();
        for (size_t i = 0; i < words.size(); ++i) lens[i] = words[i].size();
        return (int) words.size();
    } catch (...) {
        return INT_MIN;
    }
}
"""


def c_string_literals(block: str):
    """The C string literals of a brace-enclosed initializer, comments dropped."""
    import ast
    import re
    out = []
    for line in block.split("\n"):
        line = line.strip()
        if not line or line.startswith("//"):
            continue
        m = re.match(r'("(?:[^"\\]|\\.)*")\s*,?\s*(//.*)?$', line)
        if not m:
            raise ValueError(f"cannot parse regex line: {line}")
        out.append(ast.literal_eval(m.group(1)))
    return out


def parse_pre_tokenizers(vocab_cpp: str):
    """Names -> (type, flags) from llama_vocab::impl::load; type -> (regexes, byte_encode)
    from llm_tokenizer_bpe's constructor."""
    import re
    start = vocab_cpp.index('} else if (tokenizer_pre == "default") {')
    end = vocab_cpp.index('throw std::runtime_error(format("unknown pre-tokenizer type', start)
    names = {}
    for block in re.split(r"\}\s*else if\s*\(", vocab_cpp[start:end]):
        found = re.findall(r'tokenizer_pre == "([^"]+)"', block)
        if not found:
            continue
        ptype = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", block).group(1)
        flags = {k: v for k, v in re.findall(r"\n\s*([\w.]+) = ([\w:]+);", block) if k != "pre_type"}
        for n in found:
            names[n] = {"type": ptype, "flags": flags}
    start = vocab_cpp.index("switch (vocab.get_pre_type()) {")
    end = vocab_cpp.index("std::vector<std::string> regex_exprs;", start)
    types = {}
    for part in re.split(r"\n\s*break;", vocab_cpp[start:end]):
        m = re.search(r"regex_exprs = \{(.*?)\n\s*\};", part, re.S)
        if not m:
            continue
        cases = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", part)
        if "default:" in part:
            cases.append("DEFAULT")
        entry = {"regexes": c_string_literals(m.group(1)), "byte_encode": "byte_encode = false" not in part}
        for c in cases:
            types[c] = entry
    return names, types


def pretokenizer_golden(lib) -> dict | None:
    import shutil
    import subprocess
    import tempfile
    vocab_cpp = Path(lib.__file__).resolve().parent.parent / "vendor" / "llama.cpp" / "src" / "llama-vocab.cpp"
    libdir = Path(os.environ.get("LLAMA_CPP_LIB_PATH", Path(lib.__file__).parent / "lib"))
    if not vocab_cpp.exists() or shutil.which("g++") is None or not (libdir / "libllama.so").exists():
        print(f"tokenizer_golden: pretokenizers.json kept (needs g++, {vocab_cpp} and {libdir}/libllama.so)")
        return None
    names, types = parse_pre_tokenizers(vocab_cpp.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "shim.cpp"
        so = Path(tmp) / "libspecula_split.so"
        src.write_text(SHIM)
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", str(src), "-o", str(so), f"-L{libdir}", "-lllama",
                        f"-Wl,-rpath,{libdir}"], check=True)
        shim = ctypes.CDLL(str(so))
        shim.specula_split.restype = ctypes.c_int
        shim.specula_split.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p),
                                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        for t, entry in types.items():
            exprs = [e.encode() for e in entry["regexes"]]
            arr = (ctypes.c_char_p * len(exprs))(*exprs)
            splits = []
            for text in PRE_STRINGS:
                b = text.encode()
                cap = len(b) + 8
                lens = (ctypes.c_size_t * cap)()
                n = shim.specula_split(b, len(b), arr, len(exprs), lens, cap)
                if n == -(2 ** 31):
                    splits.append(None)  # llama.cpp throws (a regex std::regex rejects)
                    continue
                assert n >= 0, n
                splits.append([x for x in lens[:n] if x > 0])
            entry["splits"] = splits
    return {
        "producer": PRODUCER.replace("vocab_only", "unicode_regex_split through a C++ shim"),
        "note": "splits: byte lengths of the words (byte_encode=false, empty words dropped); null: llama.cpp throws",
        "strings": PRE_STRINGS,
        "names": names,
        "types": types,
    }


PRODUCER = ("llama.cpp 0c1e57098 (vendored by llama-cpp-python 0.3.36) via its ctypes bindings, "
            "vocab_only; reference/tokenizer_golden.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="golden/ directory")
    ap.add_argument("--models-dir", type=Path, help="model cache of `cargo xtask fetch-models`")
    ap.add_argument("--llama-dest", type=Path, default=os.environ.get("SPECULA_LLAMA_DEST"),
                    help="DEST of reference/build_llama_cpp.sh (env SPECULA_LLAMA_DEST)")
    ap.add_argument("--stdlib", type=Path, default=Path("/root/.pyenv/versions/3.11.7/lib/python3.11"),
                    help="CPython 3.11.7 standard library directory")
    args = ap.parse_args()

    if args.llama_dest:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(args.llama_dest) / "build" / "bin")
        sys.path.insert(0, str(Path(args.llama_dest) / "llama_cpp_python-0.3.36"))
    try:
        import llama_cpp as lib  # noqa: PLC0415 (optional oracle)
        import jinja2  # noqa: F401,PLC0415
    except Exception as e:  # ImportError, or OSError when libllama.so is missing
        print(f"tokenizer_golden: skipped, llama.cpp's Python bindings are not importable ({e}); "
              "build them with reference/build_llama_cpp.sh DEST and pass --llama-dest DEST "
              "(or SPECULA_LLAMA_DEST=DEST)")
        return 0
    if not args.models_dir:
        print("tokenizer_golden: skipped, no --models-dir")
        return 0
    if not args.stdlib.is_dir():
        print(f"tokenizer_golden: skipped, no CPython standard library at {args.stdlib}")
        return 0

    lib.llama_backend_init()
    outdir = args.out / "tokenizer"
    outdir.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, file in MODELS.items():
        path = args.models_dir / file
        if not path.exists():
            print(f"tokenizer_golden: {name} not in {args.models_dir}, keeping its golden")
            continue
        g = golden_for(lib, name, path, args.stdlib)
        g["versions"] = {"python": platform.python_version(),
                         "llama_cpp_python": getattr(lib, "__version__", "?")}
        (outdir / f"{name}.json").write_text(dump(g) + "\n")
        written += 1
        print(f"tokenizer_golden: wrote {outdir / (name + '.json')}")
    print(f"tokenizer_golden: {written} model(s)")
    pre = pretokenizer_golden(lib)
    if pre is not None:
        (outdir / "pretokenizers.json").write_text(dump(pre) + "\n")
        print(f"tokenizer_golden: wrote {outdir / 'pretokenizers.json'} ({len(pre['names'])} names, "
              f"{len(pre['types'])} types)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
