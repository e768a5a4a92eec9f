#!/usr/bin/env python3
"""Golden logits of Hugging Face transformers for tiny llama, qwen2 and qwen3 models.

Writes OUT/hf_tiny/<arch>.json for arch in llama, qwen2, qwen3. Oracle: transformers'
LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM in float32 on the CPU (eager attention),
never specula's own code. Needs torch and transformers (reference/requirements-hf.txt); without
them (as a plain `cargo xtask golden` runs it, from reference/.venv) the script prints why and
exits 0, leaving golden/hf_tiny/ unchanged.

The models (one per architecture, all: vocab 256, hidden 64, 2 layers, intermediate 128, 4 query
heads and 2 K/V heads of head_dim 16, RMSNorm eps 1e-6, SiLU gated MLP, context 128):
  llama   rope theta 1e4, no biases, untied lm_head            (LlamaForCausalLM)
  qwen2   rope theta 1e6, q/k/v biases, tied embeddings        (Qwen2ForCausalLM)
  qwen3   rope theta 1e6, per-head q/k RMSNorm, untied lm_head (Qwen3ForCausalLM)

Weights. The tensors are those `save_pretrained` would store (a tied lm_head is not stored), in
the order llama.cpp's convert_hf_to_gguf.py writes them: sorted by Hugging Face name, which is the
order of the safetensors file (lm_head.weight, model.embed_tokens.weight, model.layers.0.*, ...,
model.norm.weight; "layers.10" would sort before "layers.2"). Tensor number t (its position in
that order, i.e. in the GGUF file) and element number i (row-major in the Hugging Face layout,
[out_features, in_features] for a matrix) give
    z = splitmix64((t << 32) | i)
    v = (z >> 40) - 2^23                                  (a 24-bit integer in [-2^23, 2^23))
    norm weights (input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm):
        value = f32(1 + v / 2^26)                         (in [0.875, 1.125); exact f64, one
                                                           round-to-nearest-even to f32)
    everything else: value = v / 2^23 * 2^s               (uniform in [-2^s, 2^s), exact in f32)
        s = 0 for embed_tokens, -1 for q_proj (sharper attention), -3 for down_proj (128
        inputs), -2 for every other matrix (k/v/o, gate/up, lm_head) and for the q/k/v biases
where splitmix64(x) is Vigna's finalizer of x + 0x9E3779B97F4A7C15 (u64 wrapping arithmetic).

The GGUF. The same weights written as an F32 GGUF by gguf-py's GGUFWriter, as
convert_hf_to_gguf.py would write them: llama.cpp tensor names (token_embd, output, output_norm,
blk.N.attn_norm / attn_q / attn_k / attn_v / attn_output / attn_q_norm / attn_k_norm /
ffn_norm / ffn_gate / ffn_up / ffn_down, .weight / .bias), ggml dims = the numpy shape
reversed, and for llama only the converter's Q/K row permutation (LlamaModel.permute: within
each head, row h*16 + 2j + p of the GGUF is row h*16 + 8p + j of the HF weight, so that
llama.cpp's adjacent-pair RoPE on the GGUF equals transformers' rotate_half RoPE on the
original; K is permuted with the K/V head count; qwen2 and qwen3 use NeoX RoPE and are not
permuted). Metadata in the converter's order: general.architecture, general.type "model",
general.name "specula-hf-tiny-<arch>", <arch>.block_count, context_length, embedding_length,
feed_forward_length, attention.head_count, attention.head_count_kv, rope.freq_base,
attention.layer_norm_rms_epsilon, attention.key_length, attention.value_length (the config has
head_dim), general.file_type (0, all F32), for llama <arch>.vocab_size and
rope.dimension_count; then a minimal byte-level tokenizer: tokenizer.ggml.model "gpt2", pre
"default", tokens = the 256 GPT-2 byte symbols (bytes_to_unicode) in byte order, token_type all
1 (NORMAL), merges ["a 1"] (never applies), bos_token_id = eos_token_id = 0; last
general.quantization_version 2. The file is not committed, only its size and sha256: the Rust
test (crates/models/tests/hf_tiny.rs) rebuilds it with specula's GgufWriter from this
description and must reproduce it byte for byte. --keep-gguf DIR keeps the files.

The logits. For each of the token sequences of SEQUENCES, the model's logits at every position
(one forward over the whole sequence, batch 1, no padding, positions 0..n-1), float32, stored
as base64 of the little-endian f32 array [n_tokens, 256] (row-major). For scale, each sequence
also records nmse_f32_vs_f64, the NMSE of the same model run in float64 against these float32
logits (sum (f64 - f32)^2 / sum f32^2, the measure the Rust test applies to specula): the
float32 rounding noise of the oracle itself.

Cross-check (optional). With an importable llama_cpp (llama.cpp through llama-cpp-python's ctypes
bindings, found as reference/llama_golden.py finds it: --llama-dest DEST or SPECULA_LLAMA_DEST,
DEST from reference/build_llama_cpp.sh; the bindings also import diskcache and jinja2), the
script loads each GGUF in llama.cpp (F32 KV cache, no flash attention), evaluates the same
sequences with logits at every position, and records llama.cpp's NMSE against the
transformers float32 logits as nmse_llama_cpp (else null): evidence that the GGUF is what a converted
model looks like to llama.cpp, Q/K permutation included.

Per file (JSON): producer, versions, arch, hf_class, config (the transformers config as saved),
gguf {file, size, sha256, metadata keys with types, tensors [{name, hf_name, dims (ggml order),
scale_log2 (null for norm weights), permuted}]}, sequences [{name, tokens, logits_f32le_base64,
nmse_f32_vs_f64, nmse_llama_cpp, logit_std}], llama_cpp (the cross-check's version, or null).
"""

import argparse
import base64
import datetime
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

N_VOCAB, N_EMBD, N_LAYER, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM = 256, 64, 2, 128, 4, 2, 16
N_CTX = 128
RMS_EPS = 1e-6

ARCHS = {
    "llama": {"hf_class": "LlamaForCausalLM", "config": "LlamaConfig", "rope_theta": 10000.0,
              "tied": False, "permute_qk": True},
    "qwen2": {"hf_class": "Qwen2ForCausalLM", "config": "Qwen2Config", "rope_theta": 1000000.0,
              "tied": True, "permute_qk": False},
    "qwen3": {"hf_class": "Qwen3ForCausalLM", "config": "Qwen3Config", "rope_theta": 1000000.0,
              "tied": False, "permute_qk": False},
}

SEQUENCES = [
    ("mixed", [1, 17, 42, 255, 0, 99, 128, 7, 42, 17, 200, 63]),
    ("periodic", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]),
    ("short", [254, 3, 3, 3, 90, 180, 33]),
]

# One merge that never applies: a letter and a digit never share a GPT-2 pre-token, so text is
# tokenized byte by byte (llama.cpp needs a non-empty merges array; a merge whose result is not
# in the vocabulary would make it drop the merged bytes).
MERGES = ["a 1"]

# Hugging Face name (after "model.layers.N.") -> llama.cpp name (after "blk.N.").
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
}


def gguf_name(hf_name):
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    assert parts[:2] == ["model", "layers"], hf_name
    return f"blk.{parts[2]}.{LAYER_NAMES[parts[3]]}"


def scale_log2(hf_name):
    """None for norm weights, else the power of two the uniform [-1, 1) values are scaled by."""
    if hf_name.endswith(("layernorm.weight", "_norm.weight")) or hf_name == "model.norm.weight":
        return None
    if hf_name == "model.embed_tokens.weight":
        return 0
    if hf_name.endswith("down_proj.weight"):
        return -3
    if hf_name.endswith("q_proj.weight"):
        return -1
    return -2


def splitmix64(np, x):
    """Vectorized over a uint64 array; numpy's uint64 arithmetic wraps like u64::wrapping_*."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def tensor_values(np, t, shape, s):
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = splitmix64(np, (np.uint64(t) << np.uint64(32)) | i)
    v = (z >> np.uint64(40)).astype(np.int64) - (1 << 23)
    if s is None:
        x = 1.0 + v.astype(np.float64) / 2.0**26
    else:
        x = v.astype(np.float64) * 2.0 ** (s - 23)
    return x.astype(np.float32).reshape(shape)


def permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (n_head already the K/V head count for K)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def byte_symbols():
    """GPT-2's bytes_to_unicode, as the list of the 256 symbols in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    out, n = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def import_llama(dest):
    """The llama_cpp module for the cross-check, or None (after saying why)."""
    if dest is not None:
        dest = Path(dest).resolve()
        sys.path.insert(0, str(dest / "llama_cpp_python-0.3.36"))
        os.environ["LLAMA_CPP_LIB_PATH"] = str(dest / "build" / "bin")
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or OSError / RuntimeError when libllama.so is missing
        print(f"note: no llama.cpp cross-check ({type(e).__name__}: {e}); nmse_llama_cpp = null")
        return None
    return llama_cpp


def llama_cpp_logits(llama_cpp, path, token_lists):
    """llama.cpp's logits at every position of each sequence (float64 copies)."""
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2,
        n_threads_batch=2, logits_all=True, flash_attn=False, type_k=0, type_v=0, seed=0,
        verbose=False)
    out = []
    for tokens in token_lists:
        llm.reset()
        llm.eval(tokens)
        out.append([list(map(float, row)) for row in llm.scores[: len(tokens)]])
    llm.close()
    return out


def nmse_against(np, x, golden):
    """sum (x - golden)^2 / sum golden^2 in float64: the measure the Rust test applies."""
    g = np.asarray(golden, np.float64)
    return float(((np.asarray(x, np.float64) - g) ** 2).sum() / (g**2).sum())


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def make_config(transformers, arch):
    spec = ARCHS[arch]
    cls = getattr(transformers, spec["config"])
    kw = {
        "vocab_size": N_VOCAB, "hidden_size": N_EMBD, "intermediate_size": N_FF,
        "num_hidden_layers": N_LAYER, "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_HEAD_KV, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "max_position_embeddings": N_CTX, "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec["rope_theta"]},
        "tie_word_embeddings": spec["tied"], "bos_token_id": 0, "eos_token_id": 0,
    }
    if arch == "llama":
        kw["attention_bias"] = False
        kw["mlp_bias"] = False
    if arch == "qwen3":
        kw["attention_bias"] = False
    cfg = cls(**kw)
    cfg.architectures = [spec["hf_class"]]
    cfg.dtype = "float32"
    cfg._attn_implementation = "eager"
    return cfg


def build(np, torch, transformers, arch):
    """The Hugging Face model with the formula's weights, and the GGUF tensor list."""
    spec = ARCHS[arch]
    cfg = make_config(transformers, arch)
    torch.manual_seed(0)  # the random init is overwritten entirely below
    model = getattr(transformers, spec["hf_class"])(cfg).to(torch.float32).eval()
    sd = model.state_dict()
    stored = sorted(k for k in sd if not (spec["tied"] and k == "lm_head.weight"))
    new_sd, tensors = {}, []
    for t, hf_name in enumerate(stored):
        shape = tuple(sd[hf_name].shape)
        s = scale_log2(hf_name)
        hf = tensor_values(np, t, shape, s)
        new_sd[hf_name] = torch.from_numpy(hf.copy())
        data, permuted = hf, False
        if spec["permute_qk"] and hf_name.endswith("q_proj.weight"):
            data, permuted = permute(hf, N_HEAD), True
        elif spec["permute_qk"] and hf_name.endswith("k_proj.weight"):
            data, permuted = permute(hf, N_HEAD_KV), True
        tensors.append({"name": gguf_name(hf_name), "hf_name": hf_name,
                        "dims": list(reversed(shape)), "scale_log2": s, "permuted": permuted,
                        "data": np.ascontiguousarray(data)})
    if spec["tied"]:
        new_sd["lm_head.weight"] = new_sd["model.embed_tokens.weight"]
    model.load_state_dict(new_sd, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, new_sd[k]), k
    if spec["tied"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return cfg, model, tensors


def write_gguf(gguf, path, arch, tensors):
    spec = ARCHS[arch]
    # The names must be those the converter's map_tensor_name gives (gguf-py's TensorNameMap).
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], N_LAYER)
    for t in tensors:
        mapped = name_map.get_name(t["hf_name"], try_suffixes=(".weight", ".bias"))
        assert mapped == t["name"], (t["hf_name"], mapped, t["name"])
    w = gguf.GGUFWriter(str(path), arch)  # general.architecture first
    w.add_string("general.type", "model")
    w.add_string("general.name", f"specula-hf-tiny-{arch}")
    w.add_uint32(f"{arch}.block_count", N_LAYER)
    w.add_uint32(f"{arch}.context_length", N_CTX)
    w.add_uint32(f"{arch}.embedding_length", N_EMBD)
    w.add_uint32(f"{arch}.feed_forward_length", N_FF)
    w.add_uint32(f"{arch}.attention.head_count", N_HEAD)
    w.add_uint32(f"{arch}.attention.head_count_kv", N_HEAD_KV)
    w.add_float32(f"{arch}.rope.freq_base", spec["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", RMS_EPS)
    w.add_uint32(f"{arch}.attention.key_length", HEAD_DIM)
    w.add_uint32(f"{arch}.attention.value_length", HEAD_DIM)
    w.add_uint32("general.file_type", 0)
    if arch == "llama":
        w.add_uint32(f"{arch}.vocab_size", N_VOCAB)
        w.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", byte_symbols())
    w.add_array("tokenizer.ggml.token_type", [1] * N_VOCAB)
    w.add_array("tokenizer.ggml.merges", MERGES)
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    w.add_uint32("general.quantization_version", 2)
    for t in tensors:
        w.add_tensor(t["name"], t["data"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    keys = [[k, v.type.name] for k, v in w.kv_data[0].items()]
    return keys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("golden"))
    ap.add_argument("--models-dir", type=Path, help="unused (cargo xtask golden passes it)")
    ap.add_argument("--keep-gguf", type=Path, help="also keep the GGUF files in this directory")
    ap.add_argument("--llama-dest", type=Path, default=os.environ.get("SPECULA_LLAMA_DEST"),
                    help="DEST of reference/build_llama_cpp.sh, for the optional llama.cpp "
                         "cross-check (env SPECULA_LLAMA_DEST)")
    args = ap.parse_args()
    try:
        import numpy as np
        import torch
        import transformers
        import gguf
    except ImportError as e:
        print(f"skipped: hf_tiny_golden.py needs torch and transformers ({e}); install "
              f"reference/requirements-hf.txt into a venv and run the script with it "
              f"(golden/hf_tiny/ left unchanged)")
        return 0
    from importlib.metadata import version

    torch.set_num_threads(1)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "gguf": version("gguf"), "numpy": np.__version__,
                "python": platform.python_version()}
    pins = {}
    req = Path(__file__).with_name("requirements-hf.txt")
    for line in req.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, ver = line.split("==")
            pins[name.strip()] = ver.strip()
    for name, ver in pins.items():
        have = versions.get(name, "").split("+")[0]
        if have != ver:
            print(f"warning: {name} {have} is installed, requirements-hf.txt pins {ver}")

    llama_cpp = import_llama(args.llama_dest)
    llama_cpp_version = (f"llama.cpp as vendored by llama-cpp-python {llama_cpp.__version__}, "
                         f"CPU, F32 KV cache, no flash attention") if llama_cpp else None

    out_dir = args.out / "hf_tiny"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.keep_gguf:
        args.keep_gguf.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch, spec in ARCHS.items():
            cfg, model, tensors = build(np, torch, transformers, arch)
            fname = f"hf-tiny-{arch}-f32.gguf"
            path = (args.keep_gguf or Path(tmp)) / fname
            keys = write_gguf(gguf, path, arch, tensors)
            model64 = getattr(transformers, spec["hf_class"])(cfg).eval()
            model64.load_state_dict(model.state_dict())
            model64 = model64.to(torch.float64)
            cpp = (llama_cpp_logits(llama_cpp, path, [t for _, t in SEQUENCES]) if llama_cpp
                   else [None] * len(SEQUENCES))
            seqs = []
            with torch.no_grad():
                for (name, tokens), cpp_logits in zip(SEQUENCES, cpp):
                    ids = torch.tensor([tokens], dtype=torch.long)
                    logits = model(input_ids=ids).logits[0]
                    assert logits.dtype == torch.float32
                    l32 = logits.numpy().astype("<f4")
                    nmse = nmse_against(np, model64(input_ids=ids).logits[0].numpy(), l32)
                    nmse_cpp = None if cpp_logits is None else nmse_against(np, cpp_logits, l32)
                    seqs.append({
                        "name": name,
                        "tokens": tokens,
                        "logits_f32le_base64": base64.b64encode(l32.tobytes()).decode(),
                        "nmse_f32_vs_f64": nmse,
                        "nmse_llama_cpp": nmse_cpp,
                        "logit_std": float(l32.std()),
                    })
                    print(f"{arch} {name}: {len(tokens)} tokens, logit std {l32.std():.3f}, "
                          f"f32 vs f64 NMSE {nmse:.3e}, llama.cpp NMSE "
                          + ("-" if nmse_cpp is None else f"{nmse_cpp:.3e}"))
            doc = {
                "producer": "reference/hf_tiny_golden.py",
                "oracle": f"transformers {versions['transformers']} {spec['hf_class']}, "
                          f"float32, CPU, eager attention",
                "versions": versions,
                "date": datetime.date.today().isoformat(),
                "arch": arch,
                "hf_class": spec["hf_class"],
                "config": json.loads(cfg.to_json_string(use_diff=False)),
                "gguf": {
                    "file": fname,
                    "size": path.stat().st_size,
                    "sha256": sha256(path),
                    "metadata": keys,
                    "tensors": [{k: v for k, v in t.items() if k != "data"} for t in tensors],
                },
                "sequences": seqs,
                "llama_cpp": llama_cpp_version,
            }
            dst = out_dir / f"{arch}.json"
            dst.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {dst} ({dst.stat().st_size} bytes; GGUF {doc['gguf']['size']} bytes, "
                  f"sha256 {doc['gguf']['sha256']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
