#!/usr/bin/env python3
"""Golden logits of Hugging Face transformers for tiny qwen3moe, qwen35, qwen35moe, qwen3next, gemma4 and laguna models.

Writes OUT/hf_families/<name>.json for the models of MODELS (in this order): qwen3moe, qwen35,
qwen35moe, qwen3next, gemma4, gemma4_ple, laguna, laguna_perelem. Oracle: transformers' own
modelling code (Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
Qwen3NextForCausalLM, Gemma4ForCausalLM,
LagunaForCausalLM) in float32 on the CPU (eager attention, one thread), never specula's code.
Needs torch and transformers (reference/requirements-hf.txt); without them (as a plain
`cargo xtask golden` runs it, from reference/.venv) the script prints `skipped: ...` and exits
0, leaving golden/hf_families/ unchanged.

All models: vocabulary 256 (byte tokens fed as ids), hidden 64, RMSNorm eps 1e-6, context 128,
float32; the per-model configs are in the `config_*` functions and in golden/hf_families/MANIFEST.md.

Weights are defined on the GGUF side. Each model's GGUF tensor list (names, ggml dims, file
order) is the one llama.cpp's converter (conversion/*.py at llama.cpp 0c1e570) writes for that
Hugging Face model. Tensor number t (its index in the GGUF file) and element number i
(row-major over the numpy array written, i.e. shape = ggml dims reversed) give
    z = splitmix64((t << 32) | i)        (Vigna: x += 0x9E3779B97F4A7C15; z = (x ^ x>>30) *
                                          0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB;
                                          z ^ z>>31; u64 wrapping arithmetic)
    v = (z >> 40) - 2^23                 (a 24-bit signed integer in [-2^23, 2^23))
and the tensor's kind gives its value (computed in float64, one round-to-nearest-even to f32):
    "norm"         1 + v / 2^26          in [0.875, 1.125)   (every *norm.weight, and the scale
                                                              vectors that multiply: gemma4
                                                              layer_output_scale, ffn_gate_inp.scale,
                                                              ffn_down_exps.scale)
    "uniform" (s)  v * 2^(s - 23)        in [-2^s, 2^s); s = 0 for token_embd, -1 for attn_q,
                                         -3 for ffn_down / ffn_down_exps / ffn_down_shexp,
                                         -2 for every other matrix, router, bias
    "neg"          -(1 + v / 2^24)       in [-1.5, -0.5)     (qwen35 ssm_a, which the converter
                                                              writes as -exp(A_log) < 0)
    "derived"      not from the formula: computed from the config as the converter computes it
                   (gemma4 rope_freqs); the values are recorded in the JSON.
The Hugging Face state dict is then derived by inverting the converter's transforms (see the
`hf_*` functions: +1 on Qwen3.5 norms, A_log = log(-ssm_a), the V-head reordering, stacked
experts split into HF v5's fused expert parameters, ...), loaded with
load_state_dict(strict=True), and every parameter checked to be set.

Forward check (the strong one). The HF model is saved with save_pretrained (the checkpoint
layout, per-expert tensors as transformers writes them) and llama.cpp's own converter classes
(conversion/<family>.py, imported from the llama.cpp tree with its vendored gguf-py, in a
subprocess; set_vocab patched to write the byte tokenizer below, no_mtp for Qwen3.5) convert
it to an F32 GGUF. Every tensor (name, order, dims, type) and every metadata key (key, type,
value; general.size_label, which only the converter writes, aside) must equal ours; tensor data
bit for bit, except tensors through an exp/log pair (qwen35 ssm_a), which must be within 1 ulp.
Tensor names are also checked against gguf-py's get_tensor_name_map.

The GGUF. An F32 GGUF written by gguf-py's GGUFWriter (PyPI gguf 0.19.0; for laguna, which
PyPI gguf 0.19.0 does not know, the vendored gguf-py of llama.cpp 0c1e570; both write the same
bytes), metadata in the converter's key order: general.architecture, general.type, general.name,
the architecture's keys as the converter's set_gguf_parameters writes them (general.file_type 0
among them), general.quantization_version 2, then a minimal byte-level tokenizer:
tokenizer.ggml.model "gpt2", pre "default", tokens = the 256 GPT-2 byte symbols in byte order,
token_type all 1, merges ["a 1"], bos_token_id = eos_token_id = 0. The file is not committed;
the JSON lists every metadata entry [key, type, value] (arrays as {"type", "values"}) and every
tensor (name, ggml dims, type, kind, scale_log2, values for "derived"), with the file's size and
sha256, so that the Rust test can rebuild it byte for byte. --keep-gguf DIR keeps the files.

The logits. For the sequences "long" (40 tokens, longer than every sliding window) and "short"
(9 tokens): the logits at every position (one forward over the whole sequence, batch 1,
positions 0..n-1) as base64 of little-endian f32 [n, 256]; nmse_f32_vs_f64 = sum (f64 - f32)^2 /
sum f32^2, where f64 is the same model run in float64 with transformers' internal float32 casts
(torch.float32, torch.float, Tensor.float) redirected to float64 for that run; logit_std; for
MoE models the smallest gap between the k-th and (k+1)-th router selection score over every
MoE layer and token (min_router_margin, float64 run), so that a test knows how close a top-k
flip is. For "long" also hidden_states: n_layer + 1 entries as base64 f32 [n, 64]; entry j <
n_layer is the input of layer j (HF output_hidden_states[j]); entry n_layer is the output of
the last layer before the final norm (HF's own last entry is after the norm).

Per file (JSON): producer, oracle, date, versions (transformers, torch, numpy, python, and which
gguf-py wrote the file), name, arch, hf_class, config (the transformers config, to_json_string
without diff), gguf {file, size, sha256, metadata [[key, type, value]...] in file order, tensors
[{name, dims (ggml order), type, kind, scale_log2, values (derived only)}] in file order},
converter_check (what the forward check compared and found), hidden_states_note, sequences
[{name, tokens, logits_f32le_base64, nmse_f32_vs_f64, logit_std, min_router_margin (MoE),
hidden_states_f32le_base64 (long only)}].

Usage: python reference/hf_families_golden.py --out golden [--only NAME ...] [--keep-gguf DIR]
[--progress FILE]. llama.cpp's source tree (for the converter) is taken from
SPECULA_LLAMA_CPP_SRC, default /work/llsrc/llama.cpp; without it the script skips as well.
"""

import argparse
import base64
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

# Shared with the llama / qwen2 / qwen3 script (same formula, tokenizer and hashing).
from hf_tiny_golden import byte_symbols, sha256, splitmix64  # noqa: E402

LLAMA_CPP = Path(os.environ.get("SPECULA_LLAMA_CPP_SRC", "/work/llsrc/llama.cpp"))
LLAMA_CPP_COMMIT = "0c1e570"
N_VOCAB, N_EMBD, N_CTX, RMS_EPS = 256, 64, 128, 1e-6

_long = [(i * 37 + 11) % 256 for i in range(28)]
SEQUENCES = [
    ("long", _long + _long[3:9] + [_long[5]] * 3 + [42, 0, 255]),
    ("short", [254, 3, 3, 3, 90, 180, 33, 7, 128]),
]
assert len(SEQUENCES[0][1]) == 40 and len(SEQUENCES[1][1]) == 9
MERGES = ["a 1"]


# ----------------------------------------------------------------------------------------------
# The weights formula
# ----------------------------------------------------------------------------------------------

def formula_values(np, t, shape, kind, s):
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = splitmix64(np, (np.uint64(t) << np.uint64(32)) | i)
    v = (z >> np.uint64(40)).astype(np.int64) - (1 << 23)
    v = v.astype(np.float64)
    if kind == "norm":
        x = 1.0 + v / 2.0**26
    elif kind == "uniform":
        x = v * 2.0 ** (s - 23)
    elif kind == "neg":
        x = -(1.0 + v / 2.0**24)
    else:
        raise ValueError(kind)
    return x.astype(np.float32).reshape(shape)


def kind_of(name):
    """(kind, scale_log2) of a GGUF tensor by its name (the default rules of the docstring)."""
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    if name == "token_embd.weight":
        return "uniform", 0
    if "norm" in base.split(".")[0] or base in (
            "layer_output_scale.weight", "ffn_gate_inp.scale", "ffn_down_exps.scale"):
        return "norm", None
    if base == "ssm_a":
        return "neg", None
    if base.startswith("attn_q."):
        return "uniform", -1
    if base.startswith("ffn_down"):
        return "uniform", -3
    return "uniform", -2


def T(name, shape, kind=None, s=None, values=None):
    if kind is None:
        kind, s = kind_of(name)
    return {"name": name, "shape": tuple(shape), "kind": kind, "scale_log2": s, "values": values}


# ----------------------------------------------------------------------------------------------
# Byte tokenizer (same as hf_tiny_golden.py)
# ----------------------------------------------------------------------------------------------

def add_tokenizer(w):
    """The tokenizer keys, written the same way by our writer and by the patched converter."""
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", byte_symbols())
    w.add_array("tokenizer.ggml.token_type", [1] * N_VOCAB)
    w.add_array("tokenizer.ggml.merges", MERGES)
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)


# ----------------------------------------------------------------------------------------------
# Metadata helpers: entries are (key, value type name, value, element type name or None)
# ----------------------------------------------------------------------------------------------

def U32(k, v):
    return (k, "UINT32", int(v), None)


def F32(k, v):
    return (k, "FLOAT32", float(v), None)


def STR(k, v):
    return (k, "STRING", v, None)


def BOOL(k, v):
    return (k, "BOOL", bool(v), None)


def ARR(k, elem, values):
    return (k, "ARRAY", list(values), elem)


def head_meta(arch, name):
    return [STR("general.type", "model"), STR("general.name", f"specula-hf-families-{name}")]


def tail_meta():
    return [U32("general.quantization_version", 2)]


# ----------------------------------------------------------------------------------------------
# qwen3moe (conversion/qwen.py Qwen3MoeModel <- Qwen2MoeModel <- TextModel)
# ----------------------------------------------------------------------------------------------

def config_qwen3moe(tf):
    cfg = tf.Qwen3MoeConfig(
        vocab_size=N_VOCAB, hidden_size=N_EMBD, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=N_CTX, rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        attention_bias=False, bos_token_id=0, eos_token_id=0)
    return cfg


def attn_tensors(b, q_rows, kv_rows, o_cols, head_dim):
    """Sorted HF names self_attn.{k_norm, k_proj, o_proj, q_norm, q_proj, v_proj}."""
    return [
        T(f"blk.{b}.attn_k_norm.weight", (head_dim,)),
        T(f"blk.{b}.attn_k.weight", (kv_rows, N_EMBD)),
        T(f"blk.{b}.attn_output.weight", (N_EMBD, o_cols)),
        T(f"blk.{b}.attn_q_norm.weight", (head_dim,)),
        T(f"blk.{b}.attn_q.weight", (q_rows, N_EMBD)),
        T(f"blk.{b}.attn_v.weight", (kv_rows, N_EMBD)),
    ]


def layout_qwen3moe(cfg):
    E, I, hd = cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    # Safetensors order (sorted HF checkpoint names); the converter stacks the experts of a
    # layer when the last of them (experts.7.up_proj) arrives and emits down, gate, up
    # (Qwen2MoeModel.modify_tensors).
    out = [T("output.weight", (N_VOCAB, N_EMBD)), T("token_embd.weight", (N_VOCAB, N_EMBD))]
    for b in range(cfg.num_hidden_layers):
        out += [
            T(f"blk.{b}.attn_norm.weight", (N_EMBD,)),
            T(f"blk.{b}.ffn_down_exps.weight", (E, N_EMBD, I)),
            T(f"blk.{b}.ffn_gate_exps.weight", (E, I, N_EMBD)),
            T(f"blk.{b}.ffn_up_exps.weight", (E, I, N_EMBD)),
            T(f"blk.{b}.ffn_gate_inp.weight", (E, N_EMBD)),
            T(f"blk.{b}.ffn_norm.weight", (N_EMBD,)),
            *attn_tensors(b, q, kv, q, hd),
        ]
    out.append(T("output_norm.weight", (N_EMBD,)))
    return out


def hf_common(np, g, out):
    out["lm_head.weight"] = g.get("output.weight")
    out["model.embed_tokens.weight"] = g["token_embd.weight"]
    out["model.norm.weight"] = g["output_norm.weight"]


ATTN_HF = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
           "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}


def hf_qwen3moe(np, cfg, g):
    out = {}
    hf_common(np, g, out)
    for b in range(cfg.num_hidden_layers):
        p, hb = f"blk.{b}.", f"model.layers.{b}."
        for k, v in ATTN_HF.items():
            out[hb + f"self_attn.{v}.weight"] = g[p + k + ".weight"]
        out[hb + "input_layernorm.weight"] = g[p + "attn_norm.weight"]
        out[hb + "post_attention_layernorm.weight"] = g[p + "ffn_norm.weight"]
        out[hb + "mlp.gate.weight"] = g[p + "ffn_gate_inp.weight"]
        # HF v5 fuses gate and up: experts.gate_up_proj [E, 2I, H] = cat(gate, up) on dim 1
        out[hb + "mlp.experts.gate_up_proj"] = np.concatenate(
            [g[p + "ffn_gate_exps.weight"], g[p + "ffn_up_exps.weight"]], axis=1)
        out[hb + "mlp.experts.down_proj"] = g[p + "ffn_down_exps.weight"]  # [E, H, I]
    return out


def meta_qwen3moe(cfg, name):
    a = "qwen3moe"
    return head_meta(a, name) + [
        U32(f"{a}.block_count", cfg.num_hidden_layers),
        U32(f"{a}.context_length", N_CTX),
        U32(f"{a}.embedding_length", N_EMBD),
        U32(f"{a}.feed_forward_length", cfg.intermediate_size),
        U32(f"{a}.attention.head_count", cfg.num_attention_heads),
        U32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads),
        F32(f"{a}.rope.freq_base", cfg.rope_parameters["rope_theta"]),
        F32(f"{a}.attention.layer_norm_rms_epsilon", RMS_EPS),
        U32(f"{a}.expert_count", cfg.num_experts),
        U32(f"{a}.expert_used_count", cfg.num_experts_per_tok),
        U32(f"{a}.attention.key_length", cfg.head_dim),
        U32(f"{a}.attention.value_length", cfg.head_dim),
        U32("general.file_type", 0),
        U32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size),
    ] + tail_meta()


# ----------------------------------------------------------------------------------------------
# qwen35 / qwen35moe (conversion/qwen.py Qwen3_5TextModel / Qwen3_5MoeTextModel <-
# _Qwen35MRopeMixin, _LinearAttentionVReorderBase <- Qwen3NextModel <- _QwenMtpMixin, Qwen2MoeModel)
# ----------------------------------------------------------------------------------------------

QWEN35_LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def config_qwen3next(tf):
    """Qwen3-Next-80B-A3B-like: qwen35moe's layers with HF's fused projections (in_proj_qkvz,
    in_proj_ba, grouped by key head), plain partial RoPE (no sections) and a dense width."""
    return tf.Qwen3NextConfig(
        vocab_size=N_VOCAB, hidden_size=N_EMBD, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, hidden_act="silu", max_position_embeddings=N_CTX,
        rms_norm_eps=RMS_EPS, tie_word_embeddings=False, layer_types=list(QWEN35_LAYERS),
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, attention_bias=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, intermediate_size=128, bos_token_id=0, eos_token_id=0)


def config_qwen35(tf, moe=False):
    kw = dict(
        vocab_size=N_VOCAB, hidden_size=N_EMBD, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, hidden_act="silu", max_position_embeddings=N_CTX,
        rms_norm_eps=RMS_EPS, tie_word_embeddings=False, layer_types=list(QWEN35_LAYERS),
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, attention_bias=False,
        bos_token_id=0, eos_token_id=0)
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32)
        return tf.Qwen3_5MoeTextConfig(**kw)
    kw["intermediate_size"] = 128
    return tf.Qwen3_5TextConfig(**kw)


def layout_qwen35(cfg, moe=False, nxt=False):
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim, K = 2 * Hk * dk + Hv * dv, cfg.linear_conv_kernel_dim
    out = [T("output.weight", (N_VOCAB, N_EMBD)), T("token_embd.weight", (N_VOCAB, N_EMBD))]
    for b, lt in enumerate(cfg.layer_types):
        p = f"blk.{b}."
        if moe:
            E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            ffn = [
                T(p + "ffn_down_exps.weight", (E, N_EMBD, I)),
                T(p + "ffn_gate_exps.weight", (E, I, N_EMBD)),
                T(p + "ffn_up_exps.weight", (E, I, N_EMBD)),
                T(p + "ffn_gate_inp.weight", (E, N_EMBD)),
                T(p + "ffn_down_shexp.weight", (N_EMBD, Is)),
                T(p + "ffn_gate_shexp.weight", (Is, N_EMBD)),
                T(p + "ffn_up_shexp.weight", (Is, N_EMBD)),
                T(p + "ffn_gate_inp_shexp.weight", (1, N_EMBD)),
            ]
        else:
            F = cfg.intermediate_size
            ffn = [T(p + "ffn_down.weight", (N_EMBD, F)), T(p + "ffn_gate.weight", (F, N_EMBD)),
                   T(p + "ffn_up.weight", (F, N_EMBD))]
        out.append(T(p + "attn_norm.weight", (N_EMBD,)))
        if lt == "linear_attention" and nxt:
            # sorted: linear_attn.{A_log, conv1d, dt_bias, in_proj_ba, in_proj_qkvz (the
            # converter emits attn_qkv, then attn_gate), norm, out_proj}
            out += [
                T(p + "ssm_a", (Hv,)),
                T(p + "ssm_conv1d.weight", (conv_dim, K)),
                T(p + "ssm_dt.bias", (Hv,)),
                T(p + "ssm_ba.weight", (2 * Hv, N_EMBD)),
                T(p + "attn_qkv.weight", (conv_dim, N_EMBD)),
                T(p + "attn_gate.weight", (Hv * dv, N_EMBD)),
                T(p + "ssm_norm.weight", (dv,)),
                T(p + "ssm_out.weight", (N_EMBD, Hv * dv)),
                *ffn,
                T(p + "post_attention_norm.weight", (N_EMBD,)),
            ]
        elif lt == "linear_attention":
            # sorted: linear_attn.{A_log, conv1d, dt_bias, in_proj_a, in_proj_b, in_proj_qkv,
            # in_proj_z, norm, out_proj}, then mlp.*, then post_attention_layernorm
            out += [
                T(p + "ssm_a", (Hv,)),
                T(p + "ssm_conv1d.weight", (conv_dim, K)),
                T(p + "ssm_dt.bias", (Hv,)),
                T(p + "ssm_alpha.weight", (Hv, N_EMBD)),
                T(p + "ssm_beta.weight", (Hv, N_EMBD)),
                T(p + "attn_qkv.weight", (conv_dim, N_EMBD)),
                T(p + "attn_gate.weight", (Hv * dv, N_EMBD)),
                T(p + "ssm_norm.weight", (dv,)),
                T(p + "ssm_out.weight", (N_EMBD, Hv * dv)),
                *ffn,
                T(p + "post_attention_norm.weight", (N_EMBD,)),
            ]
        else:
            # sorted: mlp.*, post_attention_layernorm, self_attn.*; q_proj is 2x (q | gate per head)
            out += [
                *ffn,
                T(p + "post_attention_norm.weight", (N_EMBD,)),
                *attn_tensors(b, 2 * q, kv, q, hd),
            ]
    out.append(T("output_norm.weight", (N_EMBD,)))
    return out


def untile_v_heads(np, x, axis, n_k, n_v_per_k, head_dim):
    """Inverse of _LinearAttentionVReorderBase._reorder_v_heads (conversion/qwen.py): the GGUF
    holds V heads tiled [K0v0, K1v0, ..., K0v1, K1v1, ...] (index j*n_k + k); HF groups them by
    key head [K0v0, K0v1, ..., K1v0, ...] (index k*n_v_per_k + j)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(n_v_per_k, n_k, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def hf_qwen3next_mixer(np, cfg, g, p, la):
    """The linear attention of qwen3next: no V reordering (HF's grouped order stays), the
    converter's split of in_proj_qkvz (per key head [q, k, v, z]) into attn_qkv ([q | k | v])
    and attn_gate (z) undone; in_proj_ba (per key head [b, a]) is ssm_ba as it is."""
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = Hv // Hk
    out = {}
    a = -g[p + "ssm_a"].astype(np.float64)
    out[la + "A_log"] = np.log(a).astype(np.float32)
    out[la + "dt_bias"] = g[p + "ssm_dt.bias"]
    out[la + "conv1d.weight"] = g[p + "ssm_conv1d.weight"][:, None, :]
    out[la + "in_proj_ba.weight"] = g[p + "ssm_ba.weight"]
    qkv, z = g[p + "attn_qkv.weight"], g[p + "attn_gate.weight"]
    q, k, v = qkv[:Hk * dk], qkv[Hk * dk:2 * Hk * dk], qkv[2 * Hk * dk:]
    w = r * dv
    out[la + "in_proj_qkvz.weight"] = np.concatenate([
        np.concatenate([q[i * dk:(i + 1) * dk], k[i * dk:(i + 1) * dk], v[i * w:(i + 1) * w],
                        z[i * w:(i + 1) * w]], 0) for i in range(Hk)], 0)
    out[la + "norm.weight"] = g[p + "ssm_norm.weight"]  # gated norm: not shifted
    out[la + "out_proj.weight"] = g[p + "ssm_out.weight"]
    return out


def hf_qwen35(np, cfg, g, moe=False, nxt=False):
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = Hv // Hk
    qk = 2 * Hk * dk

    def m1(x):  # the converter adds 1 to every *norm.weight but linear_attn.norm (qwen.py
        return (x.astype(np.float64) - 1.0).astype(np.float32)  # Qwen3NextModel.modify_tensors)

    def vt(x, axis, hdim):
        return untile_v_heads(np, x, axis, Hk, r, hdim)

    out = {}
    hf_common(np, g, out)
    out["model.norm.weight"] = m1(g["output_norm.weight"])
    for b, lt in enumerate(cfg.layer_types):
        p, hb = f"blk.{b}.", f"model.layers.{b}."
        out[hb + "input_layernorm.weight"] = m1(g[p + "attn_norm.weight"])
        out[hb + "post_attention_layernorm.weight"] = m1(g[p + "post_attention_norm.weight"])
        if lt == "linear_attention" and nxt:
            out.update(hf_qwen3next_mixer(np, cfg, g, p, hb + "linear_attn."))
        elif lt == "linear_attention":
            la = hb + "linear_attn."
            a = -g[p + "ssm_a"].astype(np.float64)
            out[la + "A_log"] = vt(np.log(a).astype(np.float32), 0, 1)
            out[la + "dt_bias"] = vt(g[p + "ssm_dt.bias"], 0, 1)
            conv = g[p + "ssm_conv1d.weight"]  # [conv_dim, K]; HF [conv_dim, 1, K]
            conv = np.concatenate([conv[:qk], vt(conv[qk:], 0, dv)], axis=0)
            out[la + "conv1d.weight"] = conv[:, None, :]
            out[la + "in_proj_a.weight"] = vt(g[p + "ssm_alpha.weight"], 0, 1)
            out[la + "in_proj_b.weight"] = vt(g[p + "ssm_beta.weight"], 0, 1)
            qkv = g[p + "attn_qkv.weight"]
            out[la + "in_proj_qkv.weight"] = np.concatenate([qkv[:qk], vt(qkv[qk:], 0, dv)], 0)
            out[la + "in_proj_z.weight"] = vt(g[p + "attn_gate.weight"], 0, dv)
            out[la + "norm.weight"] = g[p + "ssm_norm.weight"]  # gated norm: not shifted
            out[la + "out_proj.weight"] = vt(g[p + "ssm_out.weight"], 1, dv)
        else:
            for k, v in ATTN_HF.items():
                x = g[p + k + ".weight"]
                out[hb + f"self_attn.{v}.weight"] = m1(x) if k.endswith("_norm") else x
        if moe:
            out[hb + "mlp.gate.weight"] = g[p + "ffn_gate_inp.weight"]
            out[hb + "mlp.experts.gate_up_proj"] = np.concatenate(
                [g[p + "ffn_gate_exps.weight"], g[p + "ffn_up_exps.weight"]], axis=1)
            out[hb + "mlp.experts.down_proj"] = g[p + "ffn_down_exps.weight"]
            for k in ("gate", "up", "down"):
                out[hb + f"mlp.shared_expert.{k}_proj.weight"] = g[p + f"ffn_{k}_shexp.weight"]
            out[hb + "mlp.shared_expert_gate.weight"] = g[p + "ffn_gate_inp_shexp.weight"]
        else:
            for k in ("gate", "up", "down"):
                out[hb + f"mlp.{k}_proj.weight"] = g[p + f"ffn_{k}.weight"]
    return out


def meta_qwen35(cfg, name, moe=False, nxt=False):
    a = "qwen3next" if nxt else "qwen35moe" if moe else "qwen35"
    rp = cfg.rope_parameters
    m = head_meta(a, name) + [
        U32(f"{a}.block_count", cfg.num_hidden_layers),
        U32(f"{a}.context_length", N_CTX),
        U32(f"{a}.embedding_length", N_EMBD),
    ]
    if not moe or nxt:
        m.append(U32(f"{a}.feed_forward_length", cfg.intermediate_size))
    m += [
        U32(f"{a}.attention.head_count", cfg.num_attention_heads),
        U32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads),
    ]
    if not nxt:  # qwen3next has no multi-section RoPE
        m.append(ARR(f"{a}.rope.dimension_sections", "INT32", list(rp["mrope_section"]) + [0]))
    m += [
        F32(f"{a}.rope.freq_base", rp["rope_theta"]),
        F32(f"{a}.attention.layer_norm_rms_epsilon", RMS_EPS),
    ]
    if moe:
        m += [U32(f"{a}.expert_count", cfg.num_experts),
              U32(f"{a}.expert_used_count", cfg.num_experts_per_tok)]
    m += [
        U32(f"{a}.attention.key_length", cfg.head_dim),
        U32(f"{a}.attention.value_length", cfg.head_dim),
        U32("general.file_type", 0),
    ]
    if moe:
        m += [U32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size),
              U32(f"{a}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)]
    m += [
        U32(f"{a}.ssm.conv_kernel", cfg.linear_conv_kernel_dim),
        U32(f"{a}.ssm.state_size", cfg.linear_key_head_dim),
        U32(f"{a}.ssm.group_count", cfg.linear_num_key_heads),
        U32(f"{a}.ssm.time_step_rank", cfg.linear_num_value_heads),
        U32(f"{a}.ssm.inner_size", cfg.linear_value_head_dim * cfg.linear_num_value_heads),
        ARR(f"{a}.attention.recurrent_layers", "BOOL",
            [t == "linear_attention" for t in cfg.layer_types]),
        U32(f"{a}.full_attention_interval", 4),
        U32(f"{a}.rope.dimension_count", int(cfg.head_dim * rp["partial_rotary_factor"])),
    ]
    return m + tail_meta()


# ----------------------------------------------------------------------------------------------
# gemma4 (conversion/gemma.py Gemma4Model <- Gemma3Model <- TextModel)
# ----------------------------------------------------------------------------------------------

GEMMA4_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA4_PLE_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def config_gemma4(tf, variant="moe"):
    kw = dict(
        vocab_size=N_VOCAB, hidden_size=N_EMBD, intermediate_size=64,
        num_attention_heads=4, head_dim=16, global_head_dim=32, sliding_window=8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6}},
        final_logit_softcapping=30.0, vocab_size_per_layer_input=N_VOCAB,
        tie_word_embeddings=True, max_position_embeddings=N_CTX, rms_norm_eps=RMS_EPS,
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)
    if variant == "moe":
        # 26B-A4B / 31B-like: K = V on the global layers, experts beside the MLP
        kw.update(
            num_hidden_layers=4, num_key_value_heads=2, num_global_key_value_heads=1,
            attention_k_eq_v=True, layer_types=list(GEMMA4_LAYERS), enable_moe_block=True,
            num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
    else:
        # E2B / E4B-like: per-layer inputs, the last 3 layers read the K/V of the last earlier
        # layer of their type (1 for sliding, 2 for global), whose MLPs are twice as wide
        kw.update(
            num_hidden_layers=6, num_key_value_heads=1, num_global_key_value_heads=1,
            attention_k_eq_v=False, layer_types=list(GEMMA4_PLE_LAYERS), enable_moe_block=False,
            hidden_size_per_layer_input=8, num_kv_shared_layers=3, use_double_wide_mlp=True)
    return tf.Gemma4TextConfig(**kw)


def gemma4_layer_dims(cfg, b):
    """(head_dim, n_kv_heads, has_v) of layer b (per_layer_config overrides on full layers)."""
    lc = cfg.per_layer_config[b]  # transformers' per-layer view of the config
    hd, kv = lc.head_dim, lc.num_key_value_heads
    full = cfg.layer_types[b] == "full_attention"
    return hd, kv, not (full and cfg.attention_k_eq_v)


def gemma4_global_kv_named(cfg):
    """Whether config.json gives the global layers' K/V heads (num_global_key_value_heads, or
    num_key_value_heads in a full-attention layer's per_layer_config)."""
    d = json.loads(cfg.to_json_string(use_diff=False))
    if d.get("num_global_key_value_heads") is not None:
        return True
    plc = d.get("per_layer_config") or {}
    return any(int(i) < len(cfg.layer_types) and cfg.layer_types[int(i)] == "full_attention"
               and "num_key_value_heads" in c for i, c in plc.items())


def gemma4_shared(cfg, b):
    """Whether layer b reads an earlier layer's K/V (Gemma4TextConfig.kv_sharing_modes)."""
    return cfg.kv_sharing_modes[b] == "reuse"


def gemma4_ff(cfg, b):
    """The MLP width of layer b: doubled on the KV-shared layers with use_double_wide_mlp."""
    return cfg.intermediate_size * (2 if cfg.use_double_wide_mlp and gemma4_shared(cfg, b) else 1)


def gemma4_rope_freqs(cfg):
    """Gemma4Model.generate_extra_tensors (conversion/gemma.py): 1.0 for the rotated frequency
    pairs of a full-attention head, 1e30 for the others (proportional RoPE)."""
    rp = cfg.rope_parameters["full_attention"]
    assert rp["rope_type"] == "proportional"
    hd = gemma4_layer_dims(cfg, cfg.layer_types.index("full_attention"))[0]
    n_rot = int(hd * rp["partial_rotary_factor"] / 2)
    return [1.0] * n_rot + [1e30] * (hd // 2 - n_rot)


def layout_gemma4(cfg):
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    nh, L, P = cfg.num_attention_heads, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
    moe = cfg.enable_moe_block
    rf = gemma4_rope_freqs(cfg)
    # generate_extra_tensors first, then the checkpoint tensors sorted by HF name (tied: no
    # output): embed_tokens, embed_tokens_per_layer, layers.*, norm, per_layer_model_projection,
    # per_layer_projection_norm
    out = [T("rope_freqs.weight", (len(rf),), "derived", None, rf),
           T("token_embd.weight", (N_VOCAB, N_EMBD))]
    if P:
        out.append(T("per_layer_token_embd.weight", (N_VOCAB, L * P)))
    for b in range(L):
        p = f"blk.{b}."
        hd, kv, has_v = gemma4_layer_dims(cfg, b)
        F = gemma4_ff(cfg, b)
        attn = attn_tensors(b, nh * hd, kv * hd, nh * hd, hd)
        if gemma4_shared(cfg, b):  # no k_proj, v_proj, k_norm (nor v_norm, weightless)
            attn = [t for t in attn if ".attn_k" not in t["name"] and ".attn_v." not in t["name"]]
        elif not has_v:
            attn = attn[:-1]
        experts = [
            T(p + "ffn_down_exps.weight", (E, N_EMBD, I)),      # experts.down_proj
            T(p + "ffn_gate_up_exps.weight", (E, 2 * I, N_EMBD)),  # experts.gate_up_proj (fused)
        ] if moe else []
        ple = [
            T(p + "inp_gate.weight", (P, N_EMBD)),              # per_layer_input_gate
            T(p + "proj.weight", (N_EMBD, P)),                  # per_layer_projection
        ] if P else []
        out += [
            *experts,
            T(p + "attn_norm.weight", (N_EMBD,)),               # input_layernorm
            T(p + "layer_output_scale.weight", (1,)),            # layer_scalar
            T(p + "ffn_down.weight", (N_EMBD, F)),
            T(p + "ffn_gate.weight", (F, N_EMBD)),
            T(p + "ffn_up.weight", (F, N_EMBD)),
            *ple,
            T(p + "post_attention_norm.weight", (N_EMBD,)),     # post_attention_layernorm
            T(p + "post_ffw_norm.weight", (N_EMBD,)),           # post_feedforward_layernorm
        ]
        if moe:
            out += [
                T(p + "post_ffw_norm_1.weight", (N_EMBD,)),     # post_feedforward_layernorm_1
                T(p + "post_ffw_norm_2.weight", (N_EMBD,)),     # post_feedforward_layernorm_2
            ]
        if P:
            out.append(T(p + "post_norm.weight", (N_EMBD,)))  # post_per_layer_input_norm
        out.append(T(p + "ffn_norm.weight", (N_EMBD,)))       # pre_feedforward_layernorm
        if moe:
            out += [
                T(p + "pre_ffw_norm_2.weight", (N_EMBD,)),      # pre_feedforward_layernorm_2
                T(p + "ffn_down_exps.scale", (E,)),             # router.per_expert_scale
                T(p + "ffn_gate_inp.weight", (E, N_EMBD)),      # router.proj
                T(p + "ffn_gate_inp.scale", (N_EMBD,)),         # router.scale
            ]
        out += attn
    out.append(T("output_norm.weight", (N_EMBD,)))
    if P:
        out += [T("per_layer_model_proj.weight", (L * P, N_EMBD)),
                T("per_layer_proj_norm.weight", (P,))]
    return out


GEMMA4_HF = {
    "ffn_down_exps.weight": "experts.down_proj", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "attn_norm.weight": "input_layernorm.weight", "layer_output_scale.weight": "layer_scalar",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    **{k + ".weight": f"self_attn.{v}.weight" for k, v in ATTN_HF.items()},
}


def hf_gemma4(np, cfg, g):
    # No transform: Gemma4Model.norm_shift is 0 (plain x*w norms), the experts stay fused in
    # the checkpoint as in the GGUF, rope_freqs is not a weight of HF (derived from the config).
    out = {}
    hf_common(np, g, out)
    ple = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
           "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
           "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
    for name, x in g.items():
        if name.startswith("blk."):
            _, b, rest = name.split(".", 2)
            out[f"model.layers.{b}.{GEMMA4_HF[rest]}"] = x
        elif name in ple:
            out[ple[name]] = x
    return out


def meta_gemma4(cfg, name):
    a = "gemma4"
    rp = cfg.rope_parameters
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    dims = [gemma4_layer_dims(cfg, b) for b in range(cfg.num_hidden_layers)]
    hd_full = dims[cfg.layer_types.index("full_attention")][0]
    hd_swa = dims[cfg.layer_types.index("sliding_attention")][0]  # the global head_dim
    ff = [gemma4_ff(cfg, b) for b in range(cfg.num_hidden_layers)]
    # Keys in the order of their first insertion: TextModel.set_gguf_parameters, then
    # Gemma3Model and Gemma4Model overwrite some (key_length, head_count_kv) in place.
    return head_meta(a, name) + [
        U32(f"{a}.block_count", cfg.num_hidden_layers),
        U32(f"{a}.context_length", N_CTX),
        U32(f"{a}.embedding_length", N_EMBD),
        # Gemma4Model replaces it in place by an array when use_double_wide_mlp
        ARR(f"{a}.feed_forward_length", "INT32", ff) if cfg.use_double_wide_mlp
        else U32(f"{a}.feed_forward_length", cfg.intermediate_size),
        U32(f"{a}.attention.head_count", cfg.num_attention_heads),
        # an array where the saved config names the global layers' K/V heads, as
        # Gemma4Model.set_gguf_parameters reads it (else TextModel's one value stays)
        ARR(f"{a}.attention.head_count_kv", "INT32", [d[1] for d in dims])
        if gemma4_global_kv_named(cfg) else U32(f"{a}.attention.head_count_kv", dims[0][1]),
        F32(f"{a}.rope.freq_base", rp["full_attention"]["rope_theta"]),
        F32(f"{a}.rope.freq_base_swa", rp["sliding_attention"]["rope_theta"]),
        F32(f"{a}.attention.layer_norm_rms_epsilon", RMS_EPS),
        *([U32(f"{a}.expert_count", cfg.num_experts),
           U32(f"{a}.expert_used_count", cfg.top_k_experts)] if cfg.enable_moe_block else []),
        U32(f"{a}.attention.key_length", hd_full),
        U32(f"{a}.attention.value_length", hd_full),
        U32("general.file_type", 0),
        F32(f"{a}.final_logit_softcapping", cfg.final_logit_softcapping),
        U32(f"{a}.attention.sliding_window", cfg.sliding_window),
        U32(f"{a}.attention.shared_kv_layers", cfg.num_kv_shared_layers),
        U32(f"{a}.embedding_length_per_layer_input", cfg.hidden_size_per_layer_input or 0),
        ARR(f"{a}.attention.sliding_window_pattern", "BOOL", swa),
        U32(f"{a}.attention.key_length_swa", hd_swa),
        U32(f"{a}.attention.value_length_swa", hd_swa),
        *([U32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)]
          if cfg.enable_moe_block else []),
        U32(f"{a}.rope.dimension_count", hd_full),
        U32(f"{a}.rope.dimension_count_swa",
            int(hd_swa * rp.get("partial_rotary_factor", 1.0))),
    ] + tail_meta()


# ----------------------------------------------------------------------------------------------
# laguna (conversion/laguna.py LagunaModel <- TextModel)
# ----------------------------------------------------------------------------------------------

def config_laguna(tf, variant):
    kw = dict(
        vocab_size=N_VOCAB, hidden_size=N_EMBD, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        moe_routed_scaling_factor=2.5, hidden_act="silu", rms_norm_eps=RMS_EPS,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=0)
    if variant == "swa_perhead":
        # XS/S-like. max_position_embeddings = factor * original (256), as transformers expects
        kw.update(
            num_hidden_layers=4, sliding_window=8, max_position_embeddings=32 * 256,
            layer_types=["full_attention"] + ["sliding_attention"] * 3,
            num_attention_heads_per_layer=[4, 8, 8, 8], mlp_layer_types=["dense"] + ["sparse"] * 3,
            gating=True,
            rope_parameters={
                "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 32.0,
                                   "original_max_position_embeddings": 256, "beta_fast": 64.0,
                                   "beta_slow": 1.0, "attention_factor": 1.0,
                                   "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                      "partial_rotary_factor": 1.0}})
    else:
        # M.1-like: all global, per-element gate, plain RoPE, no sliding window (0: the
        # converter then writes no attention.sliding_window key)
        kw.update(
            num_hidden_layers=3, sliding_window=0, max_position_embeddings=N_CTX,
            layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"],
            gating="per-element",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5,
                                                "partial_rotary_factor": 0.5}})
    return tf.LagunaConfig(**kw)


def laguna_gate_rows(cfg, b):
    nh = cfg.num_attention_heads_per_layer[b]
    per_element = isinstance(cfg.gating, str) and cfg.gating.replace("-", "_") == "per_element"
    return nh * cfg.head_dim if per_element else nh


def layout_laguna(cfg):
    E, I, Is, F = (cfg.num_experts, cfg.moe_intermediate_size,
                   cfg.shared_expert_intermediate_size, cfg.intermediate_size)
    hd, kv = cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = [T("output.weight", (N_VOCAB, N_EMBD)), T("token_embd.weight", (N_VOCAB, N_EMBD))]
    for b in range(cfg.num_hidden_layers):
        p = f"blk.{b}."
        q = cfg.num_attention_heads_per_layer[b] * hd
        out.append(T(p + "attn_norm.weight", (N_EMBD,)))
        if cfg.mlp_layer_types[b] == "dense":
            out += [T(p + "ffn_down.weight", (N_EMBD, F)), T(p + "ffn_gate.weight", (F, N_EMBD)),
                    T(p + "ffn_up.weight", (F, N_EMBD))]
        else:
            # LagunaModel.modify_tensors stacks the experts when the last one arrives and emits
            # gate, up, down; then experts.e_score_correction_bias, gate, shared_expert.*
            out += [
                T(p + "ffn_gate_exps.weight", (E, I, N_EMBD)),
                T(p + "ffn_up_exps.weight", (E, I, N_EMBD)),
                T(p + "ffn_down_exps.weight", (E, N_EMBD, I)),
                T(p + "exp_probs_b.bias", (E,)),
                T(p + "ffn_gate_inp.weight", (E, N_EMBD)),
                T(p + "ffn_down_shexp.weight", (N_EMBD, Is)),
                T(p + "ffn_gate_shexp.weight", (Is, N_EMBD)),
                T(p + "ffn_up_shexp.weight", (Is, N_EMBD)),
            ]
        out += [
            T(p + "ffn_norm.weight", (N_EMBD,)),                      # post_attention_layernorm
            T(p + "attn_gate.weight", (laguna_gate_rows(cfg, b), N_EMBD)),  # self_attn.g_proj
            *attn_tensors(b, q, kv, q, hd),
        ]
    out.append(T("output_norm.weight", (N_EMBD,)))
    return out


def hf_laguna(np, cfg, g):
    out = {}
    hf_common(np, g, out)
    for b in range(cfg.num_hidden_layers):
        p, hb = f"blk.{b}.", f"model.layers.{b}."
        for k, v in ATTN_HF.items():
            out[hb + f"self_attn.{v}.weight"] = g[p + k + ".weight"]
        out[hb + "self_attn.g_proj.weight"] = g[p + "attn_gate.weight"]
        out[hb + "input_layernorm.weight"] = g[p + "attn_norm.weight"]
        out[hb + "post_attention_layernorm.weight"] = g[p + "ffn_norm.weight"]
        if cfg.mlp_layer_types[b] == "dense":
            for k in ("gate", "up", "down"):
                out[hb + f"mlp.{k}_proj.weight"] = g[p + f"ffn_{k}.weight"]
        else:
            out[hb + "mlp.gate.weight"] = g[p + "ffn_gate_inp.weight"]
            out[hb + "mlp.gate.e_score_correction_bias"] = g[p + "exp_probs_b.bias"]
            out[hb + "mlp.experts.gate_up_proj"] = np.concatenate(
                [g[p + "ffn_gate_exps.weight"], g[p + "ffn_up_exps.weight"]], axis=1)
            out[hb + "mlp.experts.down_proj"] = g[p + "ffn_down_exps.weight"]
            for k in ("gate", "up", "down"):
                out[hb + f"mlp.shared_experts.{k}_proj.weight"] = g[p + f"ffn_{k}_shexp.weight"]
    return out


def meta_laguna(cfg, name):
    a = "laguna"
    full = cfg.rope_parameters["full_attention"]
    swa = cfg.rope_parameters.get("sliding_attention")
    m = head_meta(a, name) + [
        U32(f"{a}.block_count", cfg.num_hidden_layers),
        U32(f"{a}.context_length", cfg.max_position_embeddings),
        U32(f"{a}.embedding_length", N_EMBD),
        U32(f"{a}.feed_forward_length", cfg.intermediate_size),
        ARR(f"{a}.attention.head_count", "INT32", cfg.num_attention_heads_per_layer),
        U32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads),
    ]
    if full["rope_type"] == "yarn":
        m += [
            STR(f"{a}.rope.scaling.type", "yarn"),
            F32(f"{a}.rope.scaling.factor", full["factor"]),
            U32(f"{a}.rope.scaling.original_context_length", full["original_max_position_embeddings"]),
            F32(f"{a}.rope.scaling.yarn_attn_factor", full["attention_factor"]),
            F32(f"{a}.rope.scaling.yarn_beta_fast", full["beta_fast"]),
            F32(f"{a}.rope.scaling.yarn_beta_slow", full["beta_slow"]),
        ]
    m.append(F32(f"{a}.rope.freq_base", full["rope_theta"]))
    if swa is not None:
        m.append(F32(f"{a}.rope.freq_base_swa", swa["rope_theta"]))
    m += [
        F32(f"{a}.attention.layer_norm_rms_epsilon", RMS_EPS),
        U32(f"{a}.expert_count", cfg.num_experts),
        U32(f"{a}.expert_used_count", cfg.num_experts_per_tok),
        U32(f"{a}.attention.key_length", cfg.head_dim),
        U32(f"{a}.attention.value_length", cfg.head_dim),
        U32("general.file_type", 0),
        U32(f"{a}.vocab_size", N_VOCAB),
    ]
    if cfg.sliding_window:
        m.append(U32(f"{a}.attention.sliding_window", cfg.sliding_window))
    lead = next(i for i, t in enumerate(cfg.mlp_layer_types + ["sparse"]) if t != "dense")
    m += [
        U32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size),
        U32(f"{a}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size),
        BOOL(f"{a}.expert_weights_norm", True),
        F32(f"{a}.expert_weights_scale", cfg.moe_routed_scaling_factor),
        U32(f"{a}.expert_gating_func", 2),  # gguf.ExpertGatingFuncType.SIGMOID
        U32(f"{a}.leading_dense_block_count", lead),
        U32(f"{a}.rope.dimension_count", int(cfg.head_dim * full.get("partial_rotary_factor", 1.0))),
    ]
    if swa is not None:
        m.append(U32(f"{a}.rope.dimension_count_swa",
                     int(cfg.head_dim * swa.get("partial_rotary_factor", 1.0))))
    return m + tail_meta()


# ----------------------------------------------------------------------------------------------
# The model table
# ----------------------------------------------------------------------------------------------

MODELS = {
    "qwen3moe": {
        "arch": "qwen3moe", "hf_class": "Qwen3MoeForCausalLM", "config": config_qwen3moe,
        "layout": layout_qwen3moe, "to_hf": hf_qwen3moe, "meta": meta_qwen3moe,
        "converter": "conversion/qwen.py Qwen3MoeModel (Qwen2MoeModel.modify_tensors)",
        "router": ("mlp.gate", "softmax"),
    },
    "qwen35": {
        "arch": "qwen35", "hf_class": "Qwen3_5ForCausalLM", "config": config_qwen35,
        "layout": layout_qwen35, "to_hf": hf_qwen35, "meta": meta_qwen35,
        "converter": "conversion/qwen.py Qwen3_5TextModel (_LinearAttentionVReorderBase, "
                     "Qwen3NextModel.modify_tensors), no_mtp",
        "router": None,
    },
    "qwen35moe": {
        "arch": "qwen35moe", "hf_class": "Qwen3_5MoeForCausalLM",
        "config": lambda tf: config_qwen35(tf, moe=True),
        "layout": lambda cfg: layout_qwen35(cfg, moe=True),
        "to_hf": lambda np, cfg, g: hf_qwen35(np, cfg, g, moe=True),
        "meta": lambda cfg, name: meta_qwen35(cfg, name, moe=True),
        "converter": "conversion/qwen.py Qwen3_5MoeTextModel (_LinearAttentionVReorderBase, "
                     "Qwen3NextModel / Qwen2MoeModel.modify_tensors), no_mtp",
        "router": ("mlp.gate", "softmax"),
    },
    "qwen3next": {
        "arch": "qwen3next", "hf_class": "Qwen3NextForCausalLM", "config": config_qwen3next,
        "layout": lambda cfg: layout_qwen35(cfg, moe=True, nxt=True),
        "to_hf": lambda np, cfg, g: hf_qwen35(np, cfg, g, moe=True, nxt=True),
        "meta": lambda cfg, name: meta_qwen35(cfg, name, moe=True, nxt=True),
        "converter": "conversion/qwen.py Qwen3NextModel (modify_tensors: in_proj_qkvz split, "
                     "Qwen2MoeModel experts), no_mtp",
        "router": ("mlp.gate", "softmax"),
    },
    "gemma4": {
        "arch": "gemma4", "hf_class": "Gemma4ForCausalLM", "config": config_gemma4,
        "layout": layout_gemma4, "to_hf": hf_gemma4, "meta": meta_gemma4,
        "converter": "conversion/gemma.py Gemma4Model (Gemma3Model.modify_tensors, "
                     "generate_extra_tensors)",
        "router": ("router", "probs"),
    },
    "gemma4_ple": {
        "arch": "gemma4", "hf_class": "Gemma4ForCausalLM",
        "config": lambda tf: config_gemma4(tf, "ple"),
        "layout": layout_gemma4, "to_hf": hf_gemma4, "meta": meta_gemma4,
        "converter": "conversion/gemma.py Gemma4Model (Gemma3Model.modify_tensors, "
                     "generate_extra_tensors)",
        "router": None,
    },
    "laguna": {
        "arch": "laguna", "hf_class": "LagunaForCausalLM",
        "config": lambda tf: config_laguna(tf, "swa_perhead"),
        "layout": layout_laguna, "to_hf": hf_laguna, "meta": meta_laguna,
        "converter": "conversion/laguna.py LagunaModel",
        "router": ("mlp.gate", "sigmoid_bias"),
    },
    "laguna_perelem": {
        "arch": "laguna", "hf_class": "LagunaForCausalLM",
        "config": lambda tf: config_laguna(tf, "full_perelem"),
        "layout": layout_laguna, "to_hf": hf_laguna, "meta": meta_laguna,
        "converter": "conversion/laguna.py LagunaModel",
        "router": ("mlp.gate", "sigmoid_bias"),
    },
}

ULP_TENSORS = ("ssm_a",)  # through exp/log: within 1 ulp of the converter's forward transform


# ----------------------------------------------------------------------------------------------
# gguf-py: PyPI (default) or the vendored copy of llama.cpp
# ----------------------------------------------------------------------------------------------

def import_gguf(vendored):
    for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
        del sys.modules[k]
    vp = str(LLAMA_CPP / "gguf-py")
    while vp in sys.path:
        sys.path.remove(vp)
    if vendored:
        sys.path.insert(0, vp)
    import gguf
    return gguf


def gguf_knows(gguf, arch):
    return any(v == arch for v in gguf.MODEL_ARCH_NAMES.values())


def write_gguf(gguf, path, arch, meta, tensors):
    w = gguf.GGUFWriter(str(path), arch)  # general.architecture first
    VT = gguf.GGUFValueType
    for key, vtype, value, elem in meta:
        w.add_key_value(key, value, VT[vtype], sub_type=VT[elem] if elem else None)
    add_tokenizer(w)
    for t in tensors:
        w.add_tensor(t["name"], t["data"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    entries = []
    for k, v in w.kv_data[0].items():
        if v.type == VT.ARRAY:
            sub = v.sub_type or VT.get_type(v.value[0])
            entries.append([k, "ARRAY", {"type": sub.name, "values": list(v.value)}])
        else:
            entries.append([k, v.type.name, v.value])
    return entries


# ----------------------------------------------------------------------------------------------
# The converter check
# ----------------------------------------------------------------------------------------------

def converter_internal(hf_arch, hf_dir, out_path, model_name):
    """Run in a subprocess: llama.cpp's converter on a save_pretrained directory."""
    sys.path.insert(0, str(LLAMA_CPP))
    gguf = import_gguf(True)
    from conversion import get_model_class
    cls = get_model_class(hf_arch)
    if hasattr(cls, "_reorder_v_heads"):
        # untile_v_heads must invert the converter's reordering also where the permutation is
        # not an involution (the tiny config's 2 key heads x 2 values per key is one)
        import numpy as np
        import torch
        for n_k, r, hd in ((2, 2, 16), (3, 2, 4), (2, 3, 5)):
            x = np.arange(n_k * r * hd * 6, dtype=np.float32).reshape(n_k * r * hd, 6)
            for axis in (0, 1):
                xa = np.ascontiguousarray(x if axis == 0 else x.T)
                fwd = cls._reorder_v_heads(torch.from_numpy(xa), axis, n_k, r, hd).numpy()
                assert np.array_equal(untile_v_heads(np, fwd, axis, n_k, r, hd), xa)
    cls.set_vocab = lambda self: add_tokenizer(self.gguf_writer)
    cls.no_mtp = True  # the --no-mtp flag (Qwen3.5: the tiny configs have no MTP block)
    m = cls(Path(hf_dir), gguf.LlamaFileType.ALL_F32, Path(out_path), eager=True,
            model_name=model_name)
    m.write()
    return 0


def reader_view(gguf, path):
    r = gguf.GGUFReader(str(path))
    kv = []
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        types = [t.name for t in f.types]
        kv.append((k, types, f.contents()))
    ts = [(t.name, [int(x) for x in t.shape], t.tensor_type.name, t.data) for t in r.tensors]
    return kv, ts


def converter_check(np, gguf, spec, name, model, ours_path, tmp):
    """Save the HF model, convert it with llama.cpp's converter, compare with our GGUF."""
    hf_dir = Path(tmp) / f"hf-{name}"
    model.save_pretrained(str(hf_dir))
    # Gemma3Model.modify_tensors cuts token_embd to the tokenizer's size, read from tokenizer.json
    (hf_dir / "tokenizer.json").write_text(json.dumps(
        {"model": {"vocab": {s: i for i, s in enumerate(byte_symbols())}}, "added_tokens": []}))
    conv_path = Path(tmp) / f"converter-{name}.gguf"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--converter-internal",
           spec["hf_class"], str(hf_dir), str(conv_path), f"specula-hf-families-{name}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"converter failed for {name}:\n{res.stdout}\n{res.stderr}")
    kv_c, ts_c = reader_view(gguf, conv_path)
    kv_o, ts_o = reader_view(gguf, ours_path)
    kv_c = [e for e in kv_c if e[0] != "general.size_label"]
    assert [e[0] for e in kv_c] == [e[0] for e in kv_o], \
        f"{name}: metadata keys differ:\n conv {[e[0] for e in kv_c]}\n ours {[e[0] for e in kv_o]}"
    for (k, tc, vc), (_, to, vo) in zip(kv_c, kv_o):
        assert tc == to, f"{name}: {k} type {tc} (converter) vs {to} (ours)"
        if tc[0] == "FLOAT32":
            assert np.float32(vc) == np.float32(vo), (k, vc, vo)
        else:
            assert vc == vo, (k, vc, vo)
    assert [t[0] for t in ts_c] == [t[0] for t in ts_o], \
        f"{name}: tensor order differs:\n conv {[t[0] for t in ts_c]}\n ours {[t[0] for t in ts_o]}"
    max_ulp, exact = {}, 0
    for (n, dc, tc, xc), (_, do, to, xo) in zip(ts_c, ts_o):
        assert dc == do and tc == to == "F32", (n, dc, do, tc, to)
        xc, xo = np.asarray(xc).reshape(-1), np.asarray(xo).reshape(-1)
        if np.array_equal(xc.view(np.uint32), xo.view(np.uint32)):
            exact += 1
            continue
        base = n.split(".", 2)[2] if n.startswith("blk.") else n
        assert base in ULP_TENSORS, f"{name}: tensor {n} differs from the converter's"
        assert np.all(np.sign(xc) == np.sign(xo))
        ulp = int(np.abs(xc.view(np.int32).astype(np.int64) - xo.view(np.int32)).max())
        assert ulp <= 1, f"{name}: tensor {n} is {ulp} ulp from the converter's"
        max_ulp[n] = ulp
    return {
        "converter": f"llama.cpp {LLAMA_CPP_COMMIT} {spec['converter']}, run on the "
                     f"save_pretrained checkpoint (set_vocab patched to the byte tokenizer)",
        "metadata_identical": True,
        "metadata_note": "every key, type and value equal; general.size_label (written only by "
                         "the converter) left out of ours",
        "tensors": len(ts_o),
        "tensors_bit_identical": exact,
        "tensors_within_1_ulp": max_ulp,
    }


# ----------------------------------------------------------------------------------------------
# Building and running the models
# ----------------------------------------------------------------------------------------------

def build(np, torch, tf, gguf, name, spec):
    cfg = spec["config"](tf)
    cfg.architectures = [spec["hf_class"]]
    cfg.dtype = "float32"
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)
    tensors = spec["layout"](cfg)
    g = {}
    for t_idx, t in enumerate(tensors):
        if t["kind"] == "derived":
            data = np.asarray(t["values"], np.float32).reshape(t["shape"])
        else:
            data = formula_values(np, t_idx, t["shape"], t["kind"], t["scale_log2"])
        t["data"] = np.ascontiguousarray(data)
        g[t["name"]] = t["data"]
    if gguf_knows(gguf, spec["arch"]):
        nm = gguf.get_tensor_name_map(
            next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == spec["arch"]),
            cfg.num_hidden_layers)
        known = {v[1] for v in nm.mapping.values()}
        for t in tensors:
            base = t["name"].rsplit(".", 1)
            key = base[0] if base[-1] in ("weight", "bias", "scale") else t["name"]
            assert key in known, f"{t['name']} is not a {spec['arch']} tensor name in gguf-py"
    torch.manual_seed(0)  # the random init is overwritten entirely below
    model = getattr(tf, spec["hf_class"])(cfg).to(torch.float32).eval()
    sd = model.state_dict()
    hf = {k: v for k, v in spec["to_hf"](np, cfg, g).items() if v is not None}
    tied = cfg.tie_word_embeddings
    if tied:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    assert set(hf) == set(sd), (sorted(set(sd) - set(hf)), sorted(set(hf) - set(sd)))
    new_sd = {}
    for k, v in hf.items():
        assert tuple(v.shape) == tuple(sd[k].shape), (k, v.shape, tuple(sd[k].shape))
        assert v.dtype == np.float32, k
        new_sd[k] = torch.from_numpy(np.ascontiguousarray(v).copy())
    model.load_state_dict(new_sd, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, new_sd[k]), k
    for k, _ in model.named_parameters():
        assert k in new_sd, k
    return cfg, model, tensors


class F64Casts:
    """Redirect transformers' internal float32 casts to float64 (for the float64 run only)."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        t = self.torch
        self.saved = (t.float32, t.float, t.Tensor.float)
        t.float32 = t.float64
        t.float = t.float64
        t.Tensor.float = lambda self, *a, **k: self.to(t.float64)
        return self

    def __exit__(self, *exc):
        t = self.torch
        t.float32, t.float, t.Tensor.float = self.saved
        return False


def router_margin(np, torch, model, spec, ids):
    """Smallest k-th vs (k+1)-th selection-score gap over all MoE layers and tokens."""
    if spec["router"] is None:
        return None
    suffix, fn = spec["router"]
    k = getattr(model.config, "num_experts_per_tok", None) or model.config.top_k_experts
    logs = []
    hooks = []
    for mname, mod in model.named_modules():
        if mname.endswith(suffix):
            def hook(mod, args, out):
                logits = out[0] if isinstance(out, tuple) else out
                logs.append((mod, logits.detach().to(torch.float64)))
            hooks.append(mod.register_forward_hook(hook))
    assert hooks, suffix
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    margin = math.inf
    for mod, logits in logs:
        if fn == "softmax":
            s = torch.softmax(logits, dim=-1)
        elif fn == "probs":
            s = logits
        elif fn == "sigmoid_bias":  # selection score of LagunaTopKRouter
            s = torch.sigmoid(logits) + mod.e_score_correction_bias.to(torch.float64)
        else:
            raise ValueError(fn)
        top = torch.sort(s, dim=-1, descending=True).values
        margin = min(margin, float((top[:, k - 1] - top[:, k]).min()))
    return margin


def run_sequences(np, torch, model, model64, spec):
    seqs = []
    L = model.config.num_hidden_layers
    for name, tokens in SEQUENCES:
        ids = torch.tensor([tokens], dtype=torch.long)
        with torch.no_grad():
            captured = {}
            h = model.model.norm.register_forward_pre_hook(
                lambda mod, args: captured.__setitem__("pre_norm", args[0].detach().clone()))
            out = model(input_ids=ids, output_hidden_states=True)
            h.remove()
            logits = out.logits[0]
            assert logits.dtype == torch.float32
            l32 = logits.numpy().astype("<f4")
            with F64Casts(torch):
                out64 = model64(input_ids=ids)
            assert out64.logits.dtype == torch.float64
            l64 = out64.logits[0].numpy()
        g = l32.astype(np.float64)
        nmse = float(((l64 - g) ** 2).sum() / (g**2).sum())
        with F64Casts(torch):
            margin = router_margin(np, torch, model64, spec, ids)
        entry = {
            "name": name,
            "tokens": tokens,
            "logits_f32le_base64": base64.b64encode(l32.tobytes()).decode(),
            "nmse_f32_vs_f64": nmse,
            "logit_std": float(l32.std()),
        }
        if margin is not None:
            entry["min_router_margin"] = margin
        if name == "long":
            hs = out.hidden_states
            assert len(hs) == L + 1
            states = [hs[j][0] for j in range(L)] + [captured["pre_norm"][0]]
            entry["hidden_states_f32le_base64"] = [
                base64.b64encode(s.numpy().astype("<f4").tobytes()).decode() for s in states]
        seqs.append(entry)
        print(f"  {name}: {len(tokens)} tokens, logit std {l32.std():.3f}, f32 vs f64 NMSE "
              f"{nmse:.3e}" + ("" if margin is None else f", min router margin {margin:.3e}"))
    return seqs


def jsonable(x):
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return x


def to_json(x, ind=0):
    """JSON with one line per metadata entry, tensor, short list; nested blocks indented."""
    pad = " " * (ind + 1)
    if isinstance(x, dict):
        if not x:
            return "{}"
        return "{\n" + ",\n".join(f"{pad}{json.dumps(k)}: {to_json(v, ind + 1)}"
                                   for k, v in x.items()) + "\n" + " " * ind + "}"
    if isinstance(x, list):
        if not x:
            return "[]"
        flat = json.dumps(x, default=jsonable)
        if all(not isinstance(e, (dict, list)) for e in x) and (
                len(flat) <= 2000 or not all(isinstance(e, str) for e in x)):
            return flat
        parts = []
        for e in x:
            c = json.dumps(e, default=jsonable)
            parts.append(to_json(e, ind + 1) if isinstance(e, dict) and len(c) > 400 else c)
        return "[\n" + ",\n".join(pad + p for p in parts) + "\n" + " " * ind + "]"
    return json.dumps(x, default=jsonable)


def do_model(np, torch, tf, name, spec, versions, out_dir, keep, tmp):
    vendored = False
    gguf = import_gguf(False)
    if not gguf_knows(gguf, spec["arch"]):
        vendored = True
        gguf = import_gguf(True)
    gguf_used = (f"gguf-py vendored in llama.cpp {LLAMA_CPP_COMMIT} ({LLAMA_CPP / 'gguf-py'}; "
                 f"PyPI gguf {versions['gguf_pypi']} lacks arch {spec['arch']})" if vendored
                 else f"PyPI gguf {versions['gguf_pypi']}")
    print(f"{name}: {spec['hf_class']}, GGUF arch {spec['arch']}, writer {gguf_used}")
    cfg, model, tensors = build(np, torch, tf, gguf, name, spec)
    fname = f"hf-families-{name}-f32.gguf"
    path = (keep or Path(tmp)) / fname
    meta = write_gguf(gguf, path, spec["arch"], spec["meta"](cfg, name), tensors)
    check = converter_check(np, gguf, spec, name, model, path, tmp)
    print(f"  converter check: {check['tensors_bit_identical']}/{check['tensors']} tensors "
          f"bit-identical, within 1 ulp: {check['tensors_within_1_ulp']}; metadata identical")
    model64 = getattr(tf, spec["hf_class"])(cfg).eval()
    model64.load_state_dict(model.state_dict())
    model64 = model64.to(torch.float64)
    seqs = run_sequences(np, torch, model, model64, spec)
    v = dict(versions)
    v.pop("gguf_pypi")
    v["gguf"] = gguf_used
    doc = {
        "producer": "reference/hf_families_golden.py",
        "oracle": f"transformers {versions['transformers']} {spec['hf_class']}, float32, CPU, "
                  f"eager attention and experts, 1 thread",
        "date": datetime.date.today().isoformat(),
        "versions": v,
        "name": name,
        "arch": spec["arch"],
        "hf_class": spec["hf_class"],
        "config": json.loads(cfg.to_json_string(use_diff=False)),
        "gguf": {
            "file": fname,
            "size": path.stat().st_size,
            "sha256": sha256(path),
            "metadata": meta,
            "tensors": [{
                "name": t["name"], "dims": list(reversed(t["shape"])), "type": "F32",
                "kind": t["kind"], "scale_log2": t["scale_log2"],
                **({"values": [float(x) for x in t["data"].reshape(-1)]}
                   if t["kind"] == "derived" else {}),
            } for t in tensors],
        },
        "converter_check": check,
        "hidden_states_note": "entry j < n_layer: input of layer j (HF output_hidden_states[j]); "
                              "entry n_layer: output of the last layer before the final norm",
        "sequences": seqs,
    }
    dst = out_dir / f"{name}.json"
    text = to_json(doc) + "\n"
    assert json.loads(text) == json.loads(json.dumps(doc, default=jsonable))
    dst.write_text(text)
    print(f"  wrote {dst} ({dst.stat().st_size} bytes; GGUF {doc['gguf']['size']} bytes, "
          f"sha256 {doc['gguf']['sha256']})")
    return doc


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--converter-internal":
        return converter_internal(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("golden"))
    ap.add_argument("--models-dir", type=Path, help="unused (cargo xtask golden passes it)")
    ap.add_argument("--only", action="append", choices=list(MODELS),
                    help="only this model (repeatable)")
    ap.add_argument("--keep-gguf", type=Path, help="also keep the GGUF files in this directory")
    ap.add_argument("--progress", type=Path, help="append '<name> done' lines to this file")
    args = ap.parse_args()
    try:
        import numpy as np
        import torch
        import transformers as tf
        import gguf  # noqa: F401
    except ImportError as e:
        print(f"skipped: hf_families_golden.py needs torch and transformers ({e}); install "
              f"reference/requirements-hf.txt into a venv and run the script with it "
              f"(golden/hf_families/ left unchanged)")
        return 0
    if not (LLAMA_CPP / "conversion" / "base.py").is_file():
        print(f"skipped: hf_families_golden.py needs llama.cpp's source tree (commit "
              f"{LLAMA_CPP_COMMIT}) at {LLAMA_CPP} (env SPECULA_LLAMA_CPP_SRC) for its converter "
              f"check (golden/hf_families/ left unchanged)")
        return 0
    from importlib.metadata import version

    torch.set_num_threads(1)
    versions = {"transformers": tf.__version__, "torch": torch.__version__,
                "gguf_pypi": version("gguf"), "numpy": np.__version__,
                "python": platform.python_version()}
    req = Path(__file__).with_name("requirements-hf.txt")
    for line in req.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            pkg, ver = (s.strip() for s in line.split("=="))
            have = versions.get("gguf_pypi" if pkg == "gguf" else pkg, "").split("+")[0]
            if have != ver:
                print(f"warning: {pkg} {have} is installed, requirements-hf.txt pins {ver}")

    out_dir = args.out / "hf_families"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.keep_gguf:
        args.keep_gguf.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            if args.only and name not in args.only:
                continue
            do_model(np, torch, tf, name, spec, versions, out_dir, args.keep_gguf, tmp)
            if args.progress:
                with open(args.progress, "a") as f:
                    f.write(f"{name} done\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
