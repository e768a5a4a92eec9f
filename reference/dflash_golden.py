#!/usr/bin/env python3
"""Golden draft logits of a tiny random DFlash drafter on a tiny random Qwen3 target.

Writes OUT/dflash/tiny.json. Oracles: transformers' Qwen3ForCausalLM (float32, eager attention)
for the target, and a PyTorch implementation of the published DFlash draft model written here
from its description (Chen, Liang, Liu, arXiv 2602.06036; reference z-lab/dflash
`DFlashDraftModel`): the context features `hidden_norm(fc(concat of target hidden states))` are
projected by every layer's k_proj / v_proj, k_norm'ed, RoPE'd at their own positions and kept in
a per-layer cache; the block [anchor, MASK x (B-1)] runs input_layernorm -> q/k/v -> q_norm /
k_norm -> RoPE -> attention over concat(cached context K/V, block K/V) with NO mask -> o_proj ->
residual -> post_attention_layernorm -> SwiGLU -> residual; final norm; logits = the target's
lm_head; block embeddings = the target's embed_tokens. The cache is cropped to the committed
positions after each round (block K/V never persist). Never specula's code. Needs torch and
transformers (reference/requirements-hf.txt); without them the script says why and exits 0.

Target: reference/hf_tiny_golden.py's qwen3 model (vocab 256, hidden 64, 4 query / 2 K/V heads of
head_dim 16, intermediate 128, rope theta 1e6, eps 1e-6, untied lm_head), with N_LAYER = 4
layers instead of 2 and the same weight formula (tensor number t in sorted-HF-name order).
The GGUF gguf-py writes for it (hf_tiny_golden.write_gguf) is recorded by sha256 only.

Drafter (HF config of a DFlashDraftModel): hidden 64, 2 layers, 4 query / 2 K/V heads of
head_dim 16, intermediate 128, rope theta 1e6, eps 1e-6, block_size 8, mask_token_id 250,
target_layer_ids [2, 0] (out of order on purpose: features are laid side by side in this order;
GGUF target_layers = [3, 1], llama.cpp's converter's id + 1). Its tensors, sorted by HF name:
fc.weight [64, 128], hidden_norm.weight, layers.{0,1}.(input_layernorm, mlp.down/gate/up_proj,
post_attention_layernorm, self_attn.k_norm/k_proj/o_proj/q_norm/q_proj/v_proj), norm.weight;
tensor number t (in that order) takes hf_tiny_golden.tensor_values(t + 1000, shape, s) with s =
None for norm weights, -3 for fc and down_proj, -1 for q_proj, -2 otherwise. The GGUF (llama.cpp
layout, `general.architecture = dflash`, written here with gguf-py, sha256 recorded): fc.weight,
enc.output_norm.weight (hidden_norm), output_norm.weight (norm), blk.N.attn_norm / attn_q /
attn_k / attn_v / attn_output / attn_q_norm / attn_k_norm / ffn_norm / ffn_gate / ffn_up /
ffn_down.weight; no token_embd / output (borrowed from the target). Metadata, in order:
general.architecture, general.type "model", general.name "specula-dflash-tiny",
dflash.block_count 2, context_length 128, embedding_length 64, feed_forward_length 128,
attention.head_count 4, attention.head_count_kv 2, rope.freq_base 1e6,
attention.layer_norm_rms_epsilon 1e-6, attention.key_length 16, attention.value_length 16,
general.file_type 0, dflash.block_size 8, dflash.target_layers (i32 [3, 1]), the target's
tokenizer keys (as hf_tiny_golden writes them), tokenizer.ggml.mask_token_id 250,
general.quantization_version 2.

Rounds (greedy, as z-lab's dflash_generate runs them):
  1. prompt P (12 tokens) through the target; features of its 12 rows; anchor = argmax of the
     last logits; draft block [anchor, MASK x 7] at positions 12..19 over an empty draft cache.
  2. verify block V = [anchor, y1, d2..d7] where y1 is the target's greedy token after anchor
     (so at least one draft is accepted) and d2..d7 the round-1 drafts; the target runs V at
     12..19 (cache from the prompt); a = leading matches with the target's argmax; the committed
     rows 0..a are the new context (positions 12..12+a); the bonus is the new anchor at 13+a;
     draft block [bonus, MASK x 7] over the cache holding positions 0..12+a.
Stored per round (f32 arrays as base64 of little-endian bytes, row-major): the new context
features [rows, 128], their first position, the block tokens and first position, and the
draft logits at all 8 block rows [8, 256]; round 2 also the whole verify batch's features and a.
nmse_f32_vs_f64 per round: the same draft forward in float64 against these float32 logits.
"""

import argparse
import base64
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_golden as H  # noqa: E402

N_LAYER_TARGET = 4
D_LAYERS = 2
BLOCK = 8
MASK_ID = 250
TARGET_LAYER_IDS = [2, 0]
PROMPT = [1, 17, 42, 255, 0, 99, 128, 7, 42, 17, 200, 63]
D_NAMES = ["input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
           "mlp.up_proj.weight", "post_attention_layernorm.weight", "self_attn.k_norm.weight",
           "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
           "self_attn.q_proj.weight", "self_attn.v_proj.weight"]


def b64(np, a):
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def draft_tensors(np):
    q, kv, e, f = H.N_HEAD * H.HEAD_DIM, H.N_HEAD_KV * H.HEAD_DIM, H.N_EMBD, H.N_FF
    shapes = {"fc.weight": (e, e * len(TARGET_LAYER_IDS)), "hidden_norm.weight": (e,),
              "norm.weight": (e,)}
    per = {"input_layernorm.weight": (e,), "mlp.down_proj.weight": (e, f),
           "mlp.gate_proj.weight": (f, e), "mlp.up_proj.weight": (f, e),
           "post_attention_layernorm.weight": (e,), "self_attn.k_norm.weight": (H.HEAD_DIM,),
           "self_attn.k_proj.weight": (kv, e), "self_attn.o_proj.weight": (e, q),
           "self_attn.q_norm.weight": (H.HEAD_DIM,), "self_attn.q_proj.weight": (q, e),
           "self_attn.v_proj.weight": (kv, e)}
    for l in range(D_LAYERS):
        for n in D_NAMES:
            shapes[f"layers.{l}.{n}"] = per[n]
    out = {}
    for t, name in enumerate(sorted(shapes)):
        if name.endswith("norm.weight"):
            s = None
        elif name == "fc.weight" or name.endswith("down_proj.weight"):
            s = -3
        elif name.endswith("q_proj.weight"):
            s = -1
        else:
            s = -2
        out[name] = H.tensor_values(np, t + 1000, shapes[name], s)
    return out


GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "mlp.down_proj.weight": "ffn_down.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight",
              "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.v_proj.weight": "attn_v.weight"}


def gguf_draft_name(hf):
    if hf == "fc.weight":
        return "fc.weight"
    if hf == "hidden_norm.weight":
        return "enc.output_norm.weight"
    if hf == "norm.weight":
        return "output_norm.weight"
    _, l, rest = hf.split(".", 2)
    return f"blk.{l}.{GGUF_LAYER[rest]}"


def write_draft_gguf(gguf, np, path, w):
    g = gguf.GGUFWriter(str(path), "dflash")
    g.add_string("general.type", "model")
    g.add_string("general.name", "specula-dflash-tiny")
    a = "dflash"
    g.add_uint32(f"{a}.block_count", D_LAYERS)
    g.add_uint32(f"{a}.context_length", H.N_CTX)
    g.add_uint32(f"{a}.embedding_length", H.N_EMBD)
    g.add_uint32(f"{a}.feed_forward_length", H.N_FF)
    g.add_uint32(f"{a}.attention.head_count", H.N_HEAD)
    g.add_uint32(f"{a}.attention.head_count_kv", H.N_HEAD_KV)
    g.add_float32(f"{a}.rope.freq_base", 1e6)
    g.add_float32(f"{a}.attention.layer_norm_rms_epsilon", H.RMS_EPS)
    g.add_uint32(f"{a}.attention.key_length", H.HEAD_DIM)
    g.add_uint32(f"{a}.attention.value_length", H.HEAD_DIM)
    g.add_uint32("general.file_type", 0)
    g.add_uint32(f"{a}.block_size", BLOCK)
    g.add_array(f"{a}.target_layers", [i + 1 for i in TARGET_LAYER_IDS])
    g.add_string("tokenizer.ggml.model", "gpt2")
    g.add_string("tokenizer.ggml.pre", "default")
    g.add_array("tokenizer.ggml.tokens", H.byte_symbols())
    g.add_array("tokenizer.ggml.token_type", [1] * H.N_VOCAB)
    g.add_array("tokenizer.ggml.merges", H.MERGES)
    g.add_uint32("tokenizer.ggml.bos_token_id", 0)
    g.add_uint32("tokenizer.ggml.eos_token_id", 0)
    g.add_uint32("tokenizer.ggml.mask_token_id", MASK_ID)
    g.add_uint32("general.quantization_version", 2)
    for name in sorted(w):
        g.add_tensor(gguf_draft_name(name), np.ascontiguousarray(w[name]))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


class DFlashRef:
    """The DFlash draft model, per layer a context cache of K (normed, roped) and V."""

    def __init__(self, torch, w, embed, lm_head, dtype):
        self.t = torch
        self.w = {k: torch.from_numpy(v.copy()).to(dtype) for k, v in w.items()}
        self.embed = embed.to(dtype)
        self.lm_head = lm_head.to(dtype)
        self.dtype = dtype
        self.cache = [None] * D_LAYERS  # (k, v) [heads_kv, len, head_dim]

    def rms(self, x, w):
        t = self.t
        var = x.pow(2).mean(-1, keepdim=True)
        return x * t.rsqrt(var + H.RMS_EPS) * w

    def rope(self, x, pos):
        # x [heads, n, d]; rotate_half convention (NeoX), theta 1e6
        t = self.t
        d = H.HEAD_DIM
        inv = 1.0 / (1e6 ** (t.arange(0, d, 2, dtype=t.float64) / d))
        ang = t.tensor(pos, dtype=t.float64)[:, None] * inv[None, :]
        emb = t.cat([ang, ang], -1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + t.cat([-x2, x1], -1) * sin

    def forward(self, ctx_feats, ctx_pos, block_tokens, block_pos):
        t, w = self.t, self.w
        hd, nh, nkv = H.HEAD_DIM, H.N_HEAD, H.N_HEAD_KV
        g = self.rms(ctx_feats.to(self.dtype) @ w["fc.weight"].T, w["hidden_norm.weight"])
        x = self.embed[t.tensor(block_tokens)]
        n = x.shape[0]
        for l in range(D_LAYERS):
            p = lambda s: w[f"layers.{l}.{s}"]  # noqa: E731
            h = self.rms(x, p("input_layernorm.weight"))
            q = (h @ p("self_attn.q_proj.weight").T).view(n, nh, hd)
            q = self.rms(q, p("self_attn.q_norm.weight")).transpose(0, 1)
            kc = (g @ p("self_attn.k_proj.weight").T).view(-1, nkv, hd)
            vc = (g @ p("self_attn.v_proj.weight").T).view(-1, nkv, hd)
            kb = (h @ p("self_attn.k_proj.weight").T).view(n, nkv, hd)
            vb = (h @ p("self_attn.v_proj.weight").T).view(n, nkv, hd)
            kc = self.rope(self.rms(kc, p("self_attn.k_norm.weight")).transpose(0, 1), ctx_pos)
            kb = self.rope(self.rms(kb, p("self_attn.k_norm.weight")).transpose(0, 1), block_pos)
            vc, vb = vc.transpose(0, 1), vb.transpose(0, 1)
            q = self.rope(q, block_pos)
            if self.cache[l] is not None:
                kc = t.cat([self.cache[l][0], kc], 1)
                vc = t.cat([self.cache[l][1], vc], 1)
            self.cache[l] = (kc, vc)  # context persists; the block does not
            k = t.cat([kc, kb], 1).repeat_interleave(nh // nkv, 0)
            v = t.cat([vc, vb], 1).repeat_interleave(nh // nkv, 0)
            att = t.softmax((q @ k.transpose(1, 2)) * hd ** -0.5, -1)  # no mask
            o = (att @ v).transpose(0, 1).reshape(n, nh * hd)
            x = x + o @ p("self_attn.o_proj.weight").T
            h = self.rms(x, p("post_attention_layernorm.weight"))
            a = t.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)
            x = x + a @ p("mlp.down_proj.weight").T
        return self.rms(x, w["norm.weight"]) @ self.lm_head.T

    def crop(self, length):
        self.cache = [(k[:, :length], v[:, :length]) for k, v in self.cache]


def features(torch, hidden_states):
    return torch.cat([hidden_states[i + 1][0] for i in TARGET_LAYER_IDS], -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="golden")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--keep-gguf", default=None)
    args = ap.parse_args()
    try:
        import numpy as np
        import torch
        import transformers
        import gguf
    except ImportError as e:
        print(f"dflash_golden.py: skipped ({e}); golden/dflash unchanged")
        return 0
    from transformers import DynamicCache

    H.N_LAYER = N_LAYER_TARGET
    cfg, target, ttensors = H.build(np, torch, transformers, "qwen3")
    w = draft_tensors(np)
    keep = Path(args.keep_gguf) if args.keep_gguf else Path(tempfile.mkdtemp())
    keep.mkdir(parents=True, exist_ok=True)
    H.write_gguf(gguf, keep / "target.gguf", "qwen3", ttensors)
    write_draft_gguf(gguf, np, keep / "dflash.gguf", w)

    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    drafts = {dt: DFlashRef(torch, w, embed, head, dt) for dt in (torch.float32, torch.float64)}

    def nmse(a, b):
        a, b = a.double(), b.double()
        return float(((a - b) ** 2).sum() / (b ** 2).sum())

    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        out = target(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True,
                     output_hidden_states=True)
        n = len(PROMPT)
        ctx1 = features(torch, out.hidden_states)
        anchor = int(out.logits[0, -1].argmax())
        block1 = [anchor] + [MASK_ID] * (BLOCK - 1)
        pos1 = list(range(n, n + BLOCK))
        res = {dt: d.forward(ctx1, list(range(n)), block1, pos1) for dt, d in drafts.items()}
        for d in drafts.values():
            d.crop(n)
        logits1 = res[torch.float32]
        d1 = [int(i) for i in logits1[1:].argmax(-1)]

        # The target's own next token after the anchor, so that at least one draft is accepted.
        c2 = DynamicCache(config=cfg)
        target(torch.tensor([PROMPT]), past_key_values=c2, use_cache=True)
        y1 = int(target(torch.tensor([[anchor]]), past_key_values=c2, use_cache=True,
                        position_ids=torch.tensor([[n]])).logits[0, -1].argmax())
        verify = [anchor, y1] + d1[1:]
        vout = target(torch.tensor([verify]), past_key_values=cache, use_cache=True,
                      output_hidden_states=True, position_ids=torch.tensor([pos1]))
        post = vout.logits[0].argmax(-1).tolist()
        a = 0
        while a < BLOCK - 1 and verify[a + 1] == post[a]:
            a += 1
        assert a >= 1, a
        bonus = post[a]
        vfeat = features(torch, vout.hidden_states)
        ctx2 = vfeat[: a + 1]
        start2 = n + a + 1
        block2 = [bonus] + [MASK_ID] * (BLOCK - 1)
        pos2 = list(range(start2, start2 + BLOCK))
        res2 = {dt: d.forward(ctx2, list(range(n, start2)), block2, pos2) for dt, d in drafts.items()}
        logits2 = res2[torch.float32]

    doc = {
        "producer": "reference/dflash_golden.py",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "target_gguf_sha256": hashlib.sha256((keep / "target.gguf").read_bytes()).hexdigest(),
        "draft_gguf_sha256": hashlib.sha256((keep / "dflash.gguf").read_bytes()).hexdigest(),
        "prompt": PROMPT,
        "rounds": [
            {"ctx_pos0": 0, "ctx_rows": n, "ctx_features": b64(np, ctx1.numpy()),
             "block": block1, "block_pos0": n, "logits": b64(np, logits1.numpy()),
             "nmse_f32_vs_f64": nmse(logits1, res[torch.float64])},
            {"ctx_pos0": n, "ctx_rows": a + 1, "ctx_features": b64(np, ctx2.numpy()),
             "verify": verify, "accepted": a, "verify_features": b64(np, vfeat.numpy()),
             "block": block2, "block_pos0": start2, "logits": b64(np, logits2.numpy()),
             "nmse_f32_vs_f64": nmse(logits2, res2[torch.float64])},
        ],
    }
    out_dir = Path(args.out) / "dflash"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tiny.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out_dir / 'tiny.json'}: accepted {a}, drafts round 1 {d1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
