#!/usr/bin/env python3
"""Golden files for `specula quantize`, produced by llama.cpp's `llama-quantize`.

Writes, under OUT/quantize/:
  tiny-llama.json   a tiny llama-architecture model (2 layers, d=256, ff=544, 4/2 heads, 512-token
                    vocab), written as an F32 GGUF by gguf-py from a formula (below), then run
                    through llama-quantize for every preset, with and without --pure, with the
                    override flags (--leave-output-tensor, --output-tensor-type,
                    --token-embedding-type), plus a few chains (requantizing a Q8_0 output,
                    converting an F16 output). For each run:
                    the output's sha256 and size, the tensor types in output order, the number of
                    tensors llama-quantize reported as falling back, or the error it failed with.
  <model>.json      for each real model found in --models-dir: the tensor types llama-quantize
                    --allow-requantize chooses for Q4_K_M, Q5_K_M, Q8_0 and Q4_0 (no data).

The input model itself is not stored, only its sha256: the Rust test rebuilds it with specula's
GGUF writer from the same formula and must reproduce it byte for byte.

Tensor values (exact in every language that has IEEE f64 and u64 wrapping arithmetic): tensor
number t (position in the file) and element number i (row-major, i.e. ggml order) give
    z = splitmix64((t << 32) | i)
    v = (z >> 40) - 2^23                                   (a 24-bit uniform integer, centred)
    2-D tensors: row = i // ne0, m = 0 if row % 61 == 60 else 8 + row % 7,
                 o = 16 if z & 0xff == 0 else 1            (rare outliers)
                 value = f32(v * m * o / 2^30)             (an exact f64, rounded once to f32)
    1-D tensors: value = f32(1 + v / 2^26)
where splitmix64(x) is Vigna's finalizer of x + 0x9E3779B97F4A7C15.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

DEFAULT_LLAMA_QUANTIZE = "/tmp/llama/build/bin/llama-quantize"

# Presets as llama-quantize names them; every one is run with and without --pure.
PRESETS = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32",
    "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M",
    "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4_MOE",
]

# Runs with the override flags, on top of every preset with and without --pure.
FLAG_RUNS = [
    ("Q4_K_M", ["--leave-output-tensor"]),
    ("Q5_K_S", ["--output-tensor-type", "q8_0", "--token-embedding-type", "q4_1"]),
    ("IQ4_XS", ["--pure", "--output-tensor-type", "bf16"]),
    ("Q3_K_M", ["--token-embedding-type", "q6_k"]),
]

# Real models: cache file name -> golden name (as `cargo xtask fetch-models` names them).
REAL_MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": "qwen2.5-coder-0.5b",
    "gemma-3-270m-q4_k_m.gguf": "gemma3-270m",
}
REAL_PRESETS = ["Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0"]

N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_LAYER, N_VOCAB = 256, 544, 4, 2, 2, 512
HEAD_DIM = N_EMBD // N_HEAD

M64 = (1 << 64) - 1


def splitmix64(x):
    """Vectorized over a uint64 array; numpy's uint64 arithmetic wraps like u64::wrapping_*."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def tensor_values(t, shape):
    """The values of tensor number `t` with numpy shape `shape` (rows, ne0) or (ne0,)."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = splitmix64((np.uint64(t) << np.uint64(32)) | i)
    v = (z >> np.uint64(40)).astype(np.int64) - (1 << 23)
    if len(shape) == 1:
        x = 1.0 + v.astype(np.float64) / 2.0**26
    else:
        ne0 = shape[-1]
        row = (i // np.uint64(ne0)).astype(np.int64)
        m = np.where(row % 61 == 60, 0, 8 + row % 7)
        o = np.where((z & np.uint64(0xFF)) == 0, 16, 1)
        x = (v * m * o).astype(np.float64) / 2.0**30
    return x.astype(np.float32).reshape(shape)


def tiny_tensors():
    """(name, numpy shape) in file order: the order convert_hf_to_gguf.py writes a llama."""
    out = [("token_embd.weight", (N_VOCAB, N_EMBD))]
    for l in range(N_LAYER):
        b = f"blk.{l}."
        out += [
            (b + "attn_norm.weight", (N_EMBD,)),
            (b + "attn_q.weight", (N_EMBD, N_EMBD)),
            (b + "attn_k.weight", (N_HEAD_KV * HEAD_DIM, N_EMBD)),
            (b + "attn_v.weight", (N_HEAD_KV * HEAD_DIM, N_EMBD)),
            (b + "attn_output.weight", (N_EMBD, N_EMBD)),
            (b + "ffn_norm.weight", (N_EMBD,)),
            (b + "ffn_gate.weight", (N_FF, N_EMBD)),
            (b + "ffn_up.weight", (N_FF, N_EMBD)),
            (b + "ffn_down.weight", (N_EMBD, N_FF)),
        ]
    out += [("output_norm.weight", (N_EMBD,)), ("output.weight", (N_VOCAB, N_EMBD))]
    return out


def write_tiny(path):
    w = GGUFWriter(str(path), "llama")  # adds general.architecture first
    w.add_string("general.name", "specula-quantize-tiny")
    w.add_uint32("general.file_type", 0)
    w.add_uint32("llama.context_length", 512)
    w.add_uint32("llama.embedding_length", N_EMBD)
    w.add_uint32("llama.block_count", N_LAYER)
    w.add_uint32("llama.feed_forward_length", N_FF)
    w.add_uint32("llama.rope.dimension_count", HEAD_DIM)
    w.add_uint32("llama.attention.head_count", N_HEAD)
    w.add_uint32("llama.attention.head_count_kv", N_HEAD_KV)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("llama.vocab_size", N_VOCAB)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", ["<|endoftext|>"] + [f"tok{i}" for i in range(1, N_VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [3] + [1] * (N_VOCAB - 1))
    w.add_array("tokenizer.ggml.merges", ["t o", "to k"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    for t, (name, shape) in enumerate(tiny_tensors()):
        w.add_tensor(name, tensor_values(t, shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Oracle:
    def __init__(self, exe):
        self.exe = exe
        self.env = dict(os.environ)
        lib = str(Path(exe).resolve().parent)
        self.env["LD_LIBRARY_PATH"] = lib + (":" + self.env["LD_LIBRARY_PATH"] if self.env.get("LD_LIBRARY_PATH") else "")
        self.build = None

    def run(self, inp, out, preset, flags=(), threads=2):
        cmd = [self.exe, *flags, str(inp), str(out), preset, str(threads)]
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
        log = p.stdout + p.stderr
        if self.build is None:
            m = re.search(r"(?im)^version: (.*)$", log)
            self.build = "libllama " + m.group(1).strip() if m else "unknown version"
        if p.returncode != 0:
            # The reason llama_model_quantize logs: "failed to quantize: <why>".
            m = re.search(r"failed to quantize: (.*)", log)
            return {"error": m.group(1).strip() if m else log.strip().splitlines()[-1]}
        m = re.search(r"(\d+) of (\d+) tensor\(s\) required fallback", log)
        r = GGUFReader(str(out))
        return {
            "sha256": sha256(out),
            "size": Path(out).stat().st_size,
            "n_fallback": int(m.group(1)) if m else 0,
            "names": [t.name for t in r.tensors],
            "types": [t.tensor_type.name for t in r.tensors],
        }


def shared_names(results):
    """Factors the (identical) tensor order out of the runs that succeeded."""
    names = None
    for r in results.values():
        if "names" in r:
            if names is None:
                names = r["names"]
            if r["names"] != names:
                sys.exit("llama-quantize wrote different tensor orders for one input")
            del r["names"]
    return names


def tiny(oracle, work, out_dir):
    inp = work / "tiny-llama-f32.gguf"
    write_tiny(inp)
    runs = {}
    for preset in PRESETS:
        for pure in (False, True):
            key = preset + (" --pure" if pure else "")
            dst = work / f"tiny-{preset}{'-pure' if pure else ''}.gguf"
            runs[key] = oracle.run(inp, dst, preset, ["--pure"] if pure else [])
            print(f"tiny {key}: {runs[key].get('sha256', runs[key].get('error'))}")
    for preset, flags in FLAG_RUNS:
        key = " ".join([preset, *flags])
        dst = work / ("flags-" + re.sub(r"[^A-Za-z0-9_]+", "-", key) + ".gguf")
        runs[key] = oracle.run(inp, dst, preset, flags)
        print(f"tiny {key}: {runs[key].get('sha256', runs[key].get('error'))}")
    # Chains over outputs of the runs above: requantizing refused and allowed, and an F16 input
    # (converted, not "requantized": llama.cpp only refuses block-quantized inputs).
    q8 = work / "tiny-Q8_0.gguf"
    f16 = work / "tiny-F16.gguf"
    chains = {
        "Q8_0 -> Q4_0": (q8, "Q4_0", []),
        "Q8_0 -> Q4_0 --allow-requantize": (q8, "Q4_0", ["--allow-requantize"]),
        "Q8_0 -> Q5_K_M --allow-requantize": (q8, "Q5_K_M", ["--allow-requantize"]),
        "F16 -> Q4_0": (f16, "Q4_0", []),
        "F16 -> Q6_K --pure": (f16, "Q6_K", ["--pure"]),
    }
    for key, (src, preset, flags) in chains.items():
        dst = work / ("chain-" + re.sub(r"[^A-Za-z0-9_]+", "-", key) + ".gguf")
        runs[key] = oracle.run(src, dst, preset, flags)
        print(f"tiny {key}: {runs[key].get('sha256', runs[key].get('error'))}")
    names = shared_names(runs)
    doc = {
        "input": {"file": inp.name, "sha256": sha256(inp), "size": inp.stat().st_size},
        "oracle": f"llama-quantize, {oracle.build}",
        "names": names,
        "runs": runs,
    }
    (out_dir / "tiny-llama.json").write_text(json.dumps(doc, indent=1) + "\n")


def real(oracle, work, out_dir, models_dir):
    for file, name in REAL_MODELS.items():
        src = models_dir / file
        if not src.exists():
            print(f"skipped: {name} not in {models_dir} (cargo xtask fetch-models {name})")
            continue
        plans = {}
        for preset in REAL_PRESETS:
            dst = work / f"{name}-{preset}.gguf"
            plans[preset] = oracle.run(src, dst, preset, ["--allow-requantize"], threads=os.cpu_count() or 2)
            dst.unlink(missing_ok=True)
            if "error" in plans[preset]:
                sys.exit(f"llama-quantize failed on {name} {preset}: {plans[preset]['error']}")
            del plans[preset]["sha256"], plans[preset]["size"]
            print(f"{name} {preset}: {plans[preset]['n_fallback']} fallbacks")
        names = shared_names(plans)
        doc = {
            "model": file,
            "input_sha256": sha256(src),
            "oracle": f"llama-quantize --allow-requantize, {oracle.build}",
            "names": names,
            "plans": plans,
        }
        (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the golden/ directory")
    ap.add_argument("--models-dir", type=Path, default=Path.home() / ".cache/specula/models")
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE", DEFAULT_LLAMA_QUANTIZE),
                    help="the llama-quantize binary (env LLAMA_QUANTIZE)")
    args = ap.parse_args()
    exe = shutil.which(args.llama_quantize) or args.llama_quantize
    if not Path(exe).is_file():
        # Without the oracle nothing can be produced; leave the committed files alone.
        print(f"skipped: llama-quantize not found at {exe} (set LLAMA_QUANTIZE); golden/quantize unchanged")
        return
    out_dir = args.out / "quantize"
    out_dir.mkdir(parents=True, exist_ok=True)
    oracle = Oracle(exe)
    with tempfile.TemporaryDirectory(prefix="specula-quantize-golden-") as work:
        work = Path(work)
        tiny(oracle, work, out_dir)
        real(oracle, work, out_dir, args.models_dir)


if __name__ == "__main__":
    main()
