#!/usr/bin/env python3
"""End-to-end model goldens from llama.cpp: greedy continuations, top-5 logits, perplexity.

Writes OUT/llama/<model>.json for each real model of MODELS found in --models-dir (a model that
is absent is skipped with a message and its committed file is left alone).

Oracle: llama.cpp 0c1e57098 as vendored by llama-cpp-python 0.3.36, CPU build of
reference/build_llama_cpp.sh, driven through the sdist's pure-ctypes Python bindings (nothing
of llama-cpp-python is compiled: the bindings load DEST/build/bin/libllama.so), plus the
`llama-perplexity` binary of the same build. Never specula's own code.

Pointing the script at a build (`reference/build_llama_cpp.sh DEST` leaves the unpacked sdist in
DEST/llama_cpp_python-0.3.36/ and the libraries and tools in DEST/build/bin/):

    reference/llama_golden.py --out golden --llama-dest DEST
    SPECULA_LLAMA_DEST=DEST cargo xtask golden          # the same, for every reference script

--llama-dest puts DEST/llama_cpp_python-0.3.36 on sys.path and sets LLAMA_CPP_LIB_PATH (the
variable the bindings read, llama_cpp/llama_cpp.py) to DEST/build/bin before importing
llama_cpp; an environment that already has PYTHONPATH and LLAMA_CPP_LIB_PATH set works too. The
interpreter needs numpy and the bindings' pure-Python imports: typing_extensions, diskcache,
jinja2 (pinned in reference/requirements.txt, so reference/.venv of `cargo xtask golden` has
them). Without an importable llama_cpp (as a plain `cargo xtask golden` runs it) the script
prints why and exits 0, leaving golden/llama/ unchanged. Without DEST/build/bin/llama-perplexity (or --llama-perplexity) the perplexity
section holds only the Python re-computation.

Per model file (JSON; logits rounded to 4 decimals, gaps to 5; all ids are llama.cpp token ids):
  oracle, settings    llama.cpp version, context / model parameters as actually passed;
  vocab               n_vocab, add_bos, add_eos, bos, eos;
  prompts[]           name, kind, text, (chat: messages, renderer, the legacy rendering),
                      (chat: only for models with a tokenizer.chat_template; Gemma-3 270m has none)
                      prompt_ids (tokenized with add_special = true, parse_special = true, as
                      llama-cli does: BOS only where the GGUF's add_bos asks), prompt_top5 (top-5
                      [id, logit] at every prompt position, from the one prefill batch),
                      generated_ids (greedy argmax, ties to the lowest id, 48 tokens or up to and
                      including an EOG token), generated_text, steps[i] = {pos, top5, gap} for the
                      logits that chose generated_ids[i] (position n_prompt - 1 + i; step 0 is the
                      last prompt position, from the prefill batch; the others from one-token
                      decodes), min_gap, steps_with_gap_below_0.5;
                      checks (llama.cpp against itself, to size tolerances): the same trajectory
                      re-evaluated as one batch (teacher forcing), and greedy reruns with flash
                      attention on and with the prompt fed one token per decode (n_ubatch 1):
                      where the argmax / greedy ids differ, max |delta logit| over the vocabulary
                      and over the golden top-5 ids (reruns: up to their first divergence);
  perplexity          file (--ppl-file, default CPython 3.11.7's Lib/textwrap.py; a warning when
                      its sha256 is not the pinned one), sha256, the evaluated tokens (chunks * n_ctx ids, add_special = true,
                      parse_special = false as llama-perplexity tokenizes), the llama-perplexity
                      runs (flash attention auto and off: per-chunk cumulative ppl, mean nll and
                      its standard error as `--ppl-output-type 1` prints them, final PPL +/-), and
                      the same method re-computed here through the bindings (per-chunk values,
                      not cumulative; flash attention off).

Greedy decoding is llama.cpp's: evaluate the prompt in batches of n_batch = n_ubatch = 512 (one
batch for every prompt but Gemma-3's long_code), then feed back one argmax token per decode.
MODEL_SETTINGS lists the models whose n_ctx / perplexity chunks / prompts differ (Gemma-3: its
sliding window only matters past position 512). Perplexity is tools/perplexity/perplexity.cpp
`perplexity()`: tokens split into consecutive windows of n_ctx, the first token of each window
replaced by BOS when add_bos (Gemma-3 only), KV cache cleared per window, and only
the second half scored: logits at positions n_ctx/2 .. n_ctx-2 against the next token, i.e.
n_ctx/2 - 1 = 255 tokens per chunk; PPL = exp(mean nll), +/- = ppl * sqrt(var(nll)/(count-1)).
"""

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36"
ORACLE = "llama.cpp 0c1e57098 (vendored by llama-cpp-python 0.3.36), CPU build of reference/build_llama_cpp.sh"

# short name (models.toml) -> file in the model cache
MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
}

# Models whose settings differ from the defaults below. Gemma-3 attends through a sliding window
# (512 positions on 270m) in five of every six layers, which only changes anything past position
# 512: its context and perplexity window are 1024 (one chunk, to keep the Rust test short: its
# scored positions 512..1022 all lie past the window), and it gets one more prompt, `long_code`,
# longer than the window (LONG_PROMPT_LINES of the perplexity text), whose greedy steps run past
# it.
MODEL_SETTINGS = {
    "gemma3-270m": {"n_ctx": 1024, "ppl_chunks": 1, "long_prompt": True},
}

PROMPTS = [
    ("fibonacci", "code", "def fibonacci(n):\n"),
    ("python_class", "code",
     "class LRUCache:\n"
     "    \"\"\"A fixed-capacity cache that evicts the least recently used key first.\"\"\"\n"
     "\n"
     "    def __init__(self, capacity: int) -> None:\n"),
    ("rust_fn", "code", "fn binary_search<T: Ord>(items: &[T], target: &T) -> Option<usize> {\n"),
    ("prose_fox", "prose", "The quick brown fox jumps over the lazy dog. This sentence is famous because"),
    ("prose_apollo", "prose", "In July 1969, the Apollo 11 mission landed the first humans on the Moon. The astronauts"),
    ("chat", "chat", "Write a Python function that returns the n-th prime number."),
]

N_CTX = 512  # default; MODEL_SETTINGS may raise it
N_BATCH = 512
N_UBATCH = 512
N_THREADS = 2
N_GEN = 48
TOPK = 5

PPL_FILE = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "textwrap.py"
PPL_SHA256 = "62867e40cdea6669b361f72af4d7daf0359f207c92cbeddfc7c7506397c1f31c"  # CPython 3.11.7
PPL_CHUNKS = 4  # default; MODEL_SETTINGS may change it
# Lines (1-based, inclusive) of the perplexity text that make the `long_code` prompt: the end of
# TextWrapper's docstring, __init__, and two private methods up to `def _split(self, text):`
# (805 Gemma-3 tokens).
LONG_PROMPT_LINES = (80, 157)


def r4(x):
    return round(float(x), 4)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def import_llama(dest):
    """Returns the llama_cpp module or None (after saying why)."""
    if dest is not None:
        dest = Path(dest).resolve()
        sys.path.insert(0, str(dest / SDIST))
        os.environ["LLAMA_CPP_LIB_PATH"] = str(dest / "build" / "bin")
    try:
        import llama_cpp  # noqa: F401
        import jinja2  # noqa: F401
        import numpy  # noqa: F401
    except Exception as e:  # ImportError, or OSError / RuntimeError when libllama.so is missing
        print(f"skipped: cannot import llama_cpp ({type(e).__name__}: {e}); build it with "
              f"reference/build_llama_cpp.sh DEST and pass --llama-dest DEST (or SPECULA_LLAMA_DEST); "
              f"golden/llama unchanged")
        return None
    return llama_cpp


class Oracle:
    def __init__(self, llama_cpp, path, flash_attn=False, n_ubatch=N_UBATCH, n_ctx=N_CTX):
        from llama_cpp import Llama
        self.lc = llama_cpp
        self.llm = Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=n_ubatch,
            n_threads=N_THREADS, n_threads_batch=N_THREADS, logits_all=True, seed=0,
            flash_attn=flash_attn, verbose=False,
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)
        self.n_vocab = self.llm.n_vocab()

    def close(self):
        self.llm.close()

    def settings(self):
        cp = self.llm.context_params
        mp = self.llm.model_params
        fa = {-1: "auto", 0: "disabled", 1: "enabled"}[cp.flash_attn_type]
        gtype = {1: "f16", 0: "f32", 8: "q8_0"}
        return {
            "n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch,
            "n_seq_max": cp.n_seq_max, "n_threads": cp.n_threads, "n_threads_batch": cp.n_threads_batch,
            "flash_attn": fa, "type_k": gtype.get(cp.type_k, cp.type_k), "type_v": gtype.get(cp.type_v, cp.type_v),
            "swa_full": bool(cp.swa_full), "kv_unified": bool(cp.kv_unified), "logits_all": True,
            "load_mode": {-1: "auto", 0: "none", 1: "mmap", 2: "mlock", 3: "mmap+mlock", 4: "direct_io"}.get(mp.load_mode, mp.load_mode),
            "use_extra_bufts (CPU weight repacking)": bool(mp.use_extra_bufts),
            "n_gpu_layers": mp.n_gpu_layers, "seed": 0,
            "system_info": self.lc.llama_print_system_info().decode().strip(),
        }

    def vocab_info(self):
        lc, v = self.lc, self.vocab
        return {
            "n_vocab": self.n_vocab,
            "add_bos": bool(lc.llama_vocab_get_add_bos(v)),
            "add_eos": bool(lc.llama_vocab_get_add_eos(v)),
            "bos": lc.llama_vocab_bos(v),
            "eos": lc.llama_vocab_eos(v),
        }

    def tokenize(self, text, parse_special):
        # add_bos=True is llama_tokenize's add_special: BOS/EOS only where the vocab asks.
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=parse_special)

    def is_eog(self, tok):
        return bool(self.lc.llama_vocab_is_eog(self.vocab, tok))

    def greedy(self, prompt_ids):
        """Returns generated ids and the (n_steps, n_vocab) logits that chose them, and the prompt logits."""
        import numpy as np
        llm = self.llm
        llm.reset()
        llm.eval(prompt_ids)
        prompt_logits = np.array(llm.scores[: len(prompt_ids)], dtype=np.float32)
        gen, step_logits = [], []
        for i in range(N_GEN):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            tok = int(np.argmax(logits))
            gen.append(tok)
            step_logits.append(logits)
            if self.is_eog(tok) or i == N_GEN - 1:
                break
            llm.eval([tok])
        return gen, np.stack(step_logits), prompt_logits

    def batch_logits(self, ids):
        import numpy as np
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def legacy_chat(self, messages):
        """llama_chat_apply_template (C++ built-in template detection, not jinja) with the GGUF template."""
        lc = self.lc
        import ctypes
        tmpl = lc.llama_model_chat_template(self.llm._model.model, None)
        msgs = (lc.llama_chat_message * len(messages))()
        keep = []
        for m, src in zip(msgs, messages):
            r, c = src["role"].encode(), src["content"].encode()
            keep += [r, c]
            m.role, m.content = r, c
        n = lc.llama_chat_apply_template(tmpl, msgs, len(messages), True, None, 0)
        if n < 0:
            return None
        buf = ctypes.create_string_buffer(n + 1)
        lc.llama_chat_apply_template(tmpl, msgs, len(messages), True, buf, n + 1)
        return buf.raw[:n].decode("utf-8")


def top5(logits):
    import numpy as np
    idx = np.argsort(-logits, kind="stable")[:TOPK]
    return [[int(i), r4(logits[i])] for i in idx]


def gap(logits):
    import numpy as np
    two = np.partition(-logits, 1)[:2]
    return round(float(-two[0] + two[1]), 5)


def render_chat(template, messages, bos, eos):
    """The GGUF's tokenizer.chat_template rendered as HF transformers / llama-cli --jinja do."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise RuntimeError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def compare(gen, steps, gen_v, steps_v, teacher_forced=False):
    """How far a variant run of llama.cpp moves from the golden trajectory: over every step when
    teacher forced, else up to and including the first step where the variant's greedy id differs."""
    import numpy as np
    n = min(len(gen_v), len(gen))
    diverge = [i for i in range(n) if gen_v[i] != gen[i]]
    upto = n if teacher_forced or not diverge else diverge[0] + 1
    a, b = steps[:upto], steps_v[:upto]
    top = np.argsort(-a, axis=1, kind="stable")[:, :TOPK]
    d5 = np.abs(np.take_along_axis(a, top, 1) - np.take_along_axis(b, top, 1))
    head = ({"argmax_differs_at_steps": diverge} if teacher_forced else
            {"same_generated_ids": gen_v == gen, "first_divergence": diverge[0] if diverge else None})
    return {
        **head,
        "compared_steps": upto,
        "max_abs_logit_diff_vocab": float(f"{np.abs(a - b).max():.3g}"),
        "max_abs_logit_diff_top5": float(f"{d5.max():.3g}"),
        "mean_abs_logit_diff_top5": float(f"{d5.mean():.3g}"),
    }


def long_prompt(text_file):
    """The `long_code` prompt: LONG_PROMPT_LINES of the perplexity text."""
    first, last = LONG_PROMPT_LINES
    lines = text_file.read_text(encoding="utf-8").splitlines(keepends=True)
    return ("long_code", "code", "".join(lines[first - 1:last]))


def prompt_cases(oracle, variants, prompts):
    import numpy as np
    llm = oracle.llm
    md = llm.metadata
    bos_text = llm.detokenize([oracle.vocab_info()["bos"]], special=True).decode("utf-8", "replace")
    eos_text = llm.detokenize([oracle.vocab_info()["eos"]], special=True).decode("utf-8", "replace")
    out = []
    for name, kind, text in prompts:
        case = {"name": name, "kind": kind}
        if kind == "chat" and "tokenizer.chat_template" not in md:
            print(f"  {name}: skipped, the model has no tokenizer.chat_template (a base model)")
            continue
        if kind == "chat":
            messages = [{"role": "user", "content": text}]
            rendered = render_chat(md["tokenizer.chat_template"], messages, bos_text, eos_text)
            legacy = oracle.legacy_chat(messages)
            case["messages"] = messages
            case["renderer"] = ("jinja2 ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) over the GGUF "
                                "tokenizer.chat_template, add_generation_prompt=True (what llama-cli --jinja, "
                                "its default, does)")
            case["legacy_llama_chat_apply_template"] = legacy
            case["legacy_same_as_text"] = legacy == rendered
            text = rendered
        case["text"] = text
        ids = oracle.tokenize(text, parse_special=True)
        t0 = time.time()
        gen, step_logits, prompt_logits = oracle.greedy(ids)
        dt = time.time() - t0
        case["prompt_ids"] = ids
        case["prompt_top5"] = [top5(row) for row in prompt_logits]
        case["generated_ids"] = gen
        case["generated_text"] = llm.detokenize(gen, special=True).decode("utf-8", "replace")
        case["stopped_at_eog"] = oracle.is_eog(gen[-1])
        n_p = len(ids)
        case["steps"] = [{"pos": n_p - 1 + i, "top5": top5(l), "gap": gap(l)} for i, l in enumerate(step_logits)]
        gaps = [s["gap"] for s in case["steps"]]
        case["min_gap"] = {"gap": min(gaps), "step": int(np.argmin(gaps))}
        assert np.array_equal(step_logits[0], prompt_logits[-1])

        case["steps_with_gap_below_0.5"] = [i for i, g in enumerate(gaps) if g < 0.5]

        # llama.cpp against itself, to size tolerances: the same trajectory re-evaluated as one
        # batch (teacher forcing), and greedy reruns with other llama.cpp settings.
        full = oracle.batch_logits(ids + gen[:-1])[n_p - 1:]
        tf = compare(gen, step_logits, [int(t) for t in full.argmax(1)], full, teacher_forced=True)
        checks = {"one_batch_teacher_forcing": tf}
        for vname, vor in variants.items():
            gen_v, steps_v, _ = vor.greedy(ids)
            checks[vname] = compare(gen, step_logits, gen_v, steps_v)
        case["checks"] = checks
        print(f"  {name}: {n_p} prompt + {len(gen)} generated in {dt:.1f}s, min gap {case['min_gap']}")
        for k, v in checks.items():
            print(f"    {k}: {v}")
        out.append(case)
    return out


def python_perplexity(oracle, tokens, n_ctx, n_chunks):
    """perplexity.cpp perplexity() re-done through the bindings (flash attention as the oracle has it)."""
    import numpy as np
    vi = oracle.vocab_info()
    first = n_ctx // 2
    chunks, nll, nll2, count = [], 0.0, 0.0, 0
    for c in range(n_chunks):
        win = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if vi["add_bos"]:
            win[0] = vi["bos"]
        logits = oracle.batch_logits(win).astype(np.float64)
        rows = logits[first:n_ctx - 1]
        tgt = np.array(tokens[c * n_ctx + first + 1:(c + 1) * n_ctx])
        m = rows.max(1)
        lse = m + np.log(np.exp(rows - m[:, None]).sum(1))
        v = lse - rows[np.arange(len(tgt)), tgt]
        nll += v.sum()
        nll2 += (v * v).sum()
        count += len(v)
        chunks.append({"ppl": r4(np.exp(v.mean())), "mean_nll": round(float(v.mean()), 6), "n_scored": len(v)})
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = float(np.exp(mean))
    return {"per_chunk": chunks, "ppl": r4(ppl), "ppl_stderr": round(ppl * float(np.sqrt(var / (count - 1))), 5),
            "mean_nll": round(mean, 6), "count": count}


def run_llama_perplexity(exe, model, text_file, fa, n_ctx, n_chunks):
    cmd = [str(exe), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx), "-b", str(N_BATCH),
           "--chunks", str(n_chunks), "-t", str(N_THREADS), "-fa", fa, "--ppl-output-type", "1", "-lv", "4"]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(Path(exe).resolve().parent) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit(f"llama-perplexity failed ({p.returncode}):\n{log[-3000:]}")
    chunks = []
    for m in re.finditer(r"(?m)^\s*(\d+)\s+(\d+\.\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s*$", log):
        chunks.append({"start": int(m.group(1)), "ppl": float(m.group(2)), "mean_nll": float(m.group(3)),
                       "nll_stderr": float(m.group(4))})
    fin = re.search(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)", log)
    fa_line = (re.search(r"Flash Attention (enabled|disabled)", log)
               or re.search(r"llama_context: flash_attn\s*=\s*(\w+)", log))
    ctx = dict(re.findall(r"llama_context: (n_ctx|n_batch|n_ubatch|n_seq_max)\s*=\s*(\d+)", log))
    kv = re.search(r"K \((\w+)\):.*V \((\w+)\):", log)
    if not fin or len(chunks) != n_chunks:
        sys.exit(f"cannot parse llama-perplexity output:\n{log[-3000:]}")
    cmdline = ["llama-perplexity"] + cmd[1:]
    cmdline[cmdline.index("-m") + 1] = Path(model).name
    cmdline[cmdline.index("-f") + 1] = text_file.name
    return {
        "command": " ".join(cmdline),
        "flash_attn_requested": fa,
        "flash_attn_resolved": fa_line.group(1) if fa_line else None,
        "context": {k: int(v) for k, v in ctx.items()},
        "type_k": kv.group(1) if kv else None, "type_v": kv.group(2) if kv else None,
        "cumulative_per_chunk": chunks,
        "ppl": float(fin.group(1)), "ppl_stderr": float(fin.group(2)),
    }


def perplexity(oracle, model_path, exe, text_file, n_ctx, n_chunks):
    text = text_file.read_text(encoding="utf-8")
    tokens = oracle.tokenize(text, parse_special=False)
    n_eval = n_chunks * n_ctx
    assert len(tokens) >= n_eval
    res = {
        "file": f"CPython {platform.python_version()} Lib/{text_file.name}",
        "sha256": sha256_file(text_file),
        "bytes": text_file.stat().st_size,
        "n_ctx": n_ctx, "n_batch": N_BATCH, "chunks": n_chunks,
        "scored_per_chunk": n_ctx - 1 - n_ctx // 2,
        "n_tokens_file": len(tokens),
        "tokenize": "add_special = true, parse_special = false (common_tokenize(ctx, text, true))",
        "bos_replaces_first_token_of_each_chunk": oracle.vocab_info()["add_bos"],
        "tokens": tokens[:n_eval],
    }
    runs = []
    if exe is not None:
        for fa in ("auto", "off"):
            runs.append(run_llama_perplexity(exe, model_path, text_file, fa, n_ctx, n_chunks))
            print(f"  llama-perplexity -fa {fa}: {runs[-1]['ppl']} +/- {runs[-1]['ppl_stderr']} "
                  f"(flash attention {runs[-1]['flash_attn_resolved']})")
    res["llama_perplexity"] = runs
    py = python_perplexity(oracle, tokens, n_ctx, n_chunks)
    py["flash_attn"] = "disabled"
    py["how"] = "bindings, logits_all at every position of each window, float64 log-softmax"
    res["python_recomputation"] = py
    print(f"  python: {py['ppl']} +/- {py['ppl_stderr']} per chunk {[c['ppl'] for c in py['per_chunk']]}")
    off = next((r for r in runs if r["flash_attn_requested"] == "off"), None)
    if off is not None and abs(off["ppl"] - py["ppl"]) > 2e-4 * py["ppl"]:
        print(f"  warning: python re-computation {py['ppl']} differs from llama-perplexity -fa off {off['ppl']}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the golden/ directory")
    ap.add_argument("--models-dir", type=Path, default=Path.home() / ".cache/specula/models")
    ap.add_argument("--llama-dest", type=Path, default=os.environ.get("SPECULA_LLAMA_DEST"),
                    help="DEST of reference/build_llama_cpp.sh (env SPECULA_LLAMA_DEST)")
    ap.add_argument("--llama-perplexity", type=Path, default=None,
                    help="the llama-perplexity binary (default: next to libllama.so)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="short names to produce")
    ap.add_argument("--ppl-file", type=Path, default=PPL_FILE)
    args = ap.parse_args()

    llama_cpp = import_llama(args.llama_dest)
    if llama_cpp is None:
        return
    import numpy as np
    import jinja2

    exe = args.llama_perplexity
    if exe is None and os.environ.get("LLAMA_CPP_LIB_PATH"):
        exe = Path(os.environ["LLAMA_CPP_LIB_PATH"]) / "llama-perplexity"
    if exe is not None and not Path(exe).is_file():
        print(f"note: no llama-perplexity at {exe}; perplexity only re-computed through the bindings")
        exe = None
    if not args.ppl_file.is_file():
        sys.exit(f"perplexity text {args.ppl_file} not found (pass --ppl-file)")
    if sha256_file(args.ppl_file) != PPL_SHA256:
        print(f"warning: {args.ppl_file} is not the committed text (CPython 3.11.7 textwrap.py, sha256 "
              f"{PPL_SHA256}); the perplexity goldens will change")

    out_dir = args.out / "llama"
    for name in args.models:
        path = args.models_dir / MODELS[name]
        if not path.is_file():
            print(f"skipped: {name} not in {args.models_dir} (cargo xtask fetch-models {name})")
            continue
        print(f"{name}: {path.name}")
        t0 = time.time()
        ms = MODEL_SETTINGS.get(name, {})
        n_ctx = ms.get("n_ctx", N_CTX)
        prompts = PROMPTS + ([long_prompt(args.ppl_file)] if ms.get("long_prompt") else [])
        oracle = Oracle(llama_cpp, path, n_ctx=n_ctx)
        variants = {
            "rerun_flash_attn_on": Oracle(llama_cpp, path, flash_attn=True, n_ctx=n_ctx),
            "rerun_prompt_one_token_per_decode (n_ubatch 1)": Oracle(llama_cpp, path, n_ubatch=1, n_ctx=n_ctx),
        }
        doc = {
            "model": path.name,
            "model_sha256": sha256_file(path),
            "oracle": ORACLE,
            "llama_cpp_python": llama_cpp.__version__,
            "producer": "reference/llama_golden.py",
            "python": platform.python_version(), "numpy": np.__version__, "jinja2": jinja2.__version__,
            "settings": oracle.settings(),
            "greedy": {"max_new_tokens": N_GEN, "argmax": "first maximum (lowest id) of the f32 logits",
                       "stop": "after an end-of-generation token (llama_vocab_is_eog)",
                       "prompt": "batches of n_batch = n_ubatch = 512 (one batch for a prompt up to 512 tokens), then one token per llama_decode"},
            "vocab": oracle.vocab_info(),
            "prompts": prompt_cases(oracle, variants, prompts),
        }
        for v in variants.values():
            v.close()
        doc["perplexity"] = perplexity(oracle, path, exe, args.ppl_file, n_ctx,
                                       ms.get("ppl_chunks", PPL_CHUNKS))
        oracle.close()
        out_dir.mkdir(parents=True, exist_ok=True)
        dst = out_dir / f"{name}.json"
        dst.write_text(compact_json(doc) + "\n")
        print(f"  wrote {dst} ({dst.stat().st_size} bytes, {time.time() - t0:.0f}s)")


def compact_json(doc, indent=0):
    """Indented JSON with flat lists (id lists, [id, logit] pairs, top-5 rows) kept on one line."""
    def scalars(v):
        return isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)

    def flat(v):  # scalars, or a list of lists of scalars
        return isinstance(v, list) and all(not isinstance(x, (dict, list)) or scalars(x) for x in v)

    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(doc, dict):
        if not doc:
            return "{}"
        if all(not isinstance(v, (dict, list)) or flat(v) for v in doc.values()):
            one = json.dumps(doc, ensure_ascii=False)
            if len(one) <= 160:
                return one
        items = [f"{inner}{json.dumps(k)}: {compact_json(v, indent + 1)}" for k, v in doc.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(doc, list):
        if flat(doc):
            return json.dumps(doc, ensure_ascii=False)
        return "[\n" + ",\n".join(inner + compact_json(v, indent + 1) for v in doc) + "\n" + pad + "]"
    return json.dumps(doc, ensure_ascii=False)


if __name__ == "__main__":
    main()
