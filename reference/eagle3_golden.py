#!/usr/bin/env python3
"""Golden chain-draft logits of a tiny random EAGLE-3 head on a tiny random Qwen3 target.

Writes OUT/eagle3/tiny.json. Oracles: transformers' Qwen3ForCausalLM (float32) for the target
(reference/dflash_golden.py's 4-layer variant of hf_tiny_golden's qwen3), and a PyTorch
implementation of the EAGLE-3 head written here from its description (Li, Wei, Zhang, Zhang,
arXiv 2503.01840; HF LlamaForCausalLMEagle3 as vLLM / SGLang / llama.cpp run it), never
specula's code: g = fc(concat of the target's hidden states at the aux layers); a decoder
row at position P takes (token[P + 1], g[P]): input_layernorm(embed(token)) and
hidden_norm(g) side by side -> q/k/v_proj -> Llama RoPE (rotate_half, theta 1e4) -> causal
attention over the head's cache -> o_proj -> + residual (g, or hidden_norm(g) when
norm_before_residual) -> post_attention_layernorm -> SwiGLU -> + residual = prenorm (the next
chain step's g) -> norm -> lm_head over the draft vocabulary; draft id i is target id d2t[i].

Aux layers: eagle_aux_hidden_state_layer_ids [1, 3, 2] (layer inputs, transformers'
hidden_states[i]; out of order on purpose), written as eagle3.target_layers unchanged.

Head (HF names, sorted; tensor t takes hf_tiny_golden.tensor_values(t + 2000 + 100 * case, shape,
s), s = None for norms, -3 for fc and down_proj, -1 for q_proj, -2 otherwise): fc.weight
[64, 192], lm_head.weight [64 (draft vocab), 64], midlayer.hidden_norm.weight,
midlayer.input_layernorm.weight, midlayer.mlp.down/gate/up_proj.weight,
midlayer.post_attention_layernorm.weight, midlayer.self_attn.k/o/q/v_proj.weight (q/k/v take
128 = 2 x 64 inputs), norm.weight. d2t: the 64 target ids 4 * i + (i % 4) (absolute, as
llama.cpp's converter stores them; HF would store the offsets d2t[i] - i). Token embeddings:
the target's. GGUF (llama.cpp layout, sha256 recorded; gguf-py writer): fc.weight, output.weight
(lm_head), output_norm.weight (norm), d2t (I64), blk.0.attn_norm (input_layernorm),
blk.0.attn_norm_2 (hidden_norm), blk.0.attn_q / attn_k (rows permuted as
convert_hf_to_gguf.py's LlamaModel.permute does, for llama.cpp's adjacent-pair RoPE),
blk.0.attn_v, blk.0.attn_output, blk.0.ffn_norm (post_attention_layernorm), blk.0.ffn_gate /
ffn_up / ffn_down; metadata: general.architecture eagle3, general.type, general.name
"specula-eagle3-tiny-<case>", eagle3.block_count 1, context_length 128, embedding_length 64,
feed_forward_length 128, attention.head_count 4, attention.head_count_kv 2, rope.freq_base 1e4,
attention.layer_norm_rms_epsilon 1e-6, general.file_type 0, eagle3.vocab_size 256,
eagle3.rope.dimension_count 16, eagle3.target_layers (i32 [1, 3, 2]), eagle3.target_hidden_size
64, eagle3.norm_before_residual, eagle3.norm_before_fc false, the target's tokenizer keys,
general.quantization_version 2.

Cases: "plain" (norm_before_residual false) and "nbr" (true). Rounds (greedy chain of 5):
  1. prompt P (12 tokens) through the target; g of its 12 rows; pairs P = 0..10 written with
     tokens P[1..12]; seed (anchor = target argmax, g[11]) at 11; chain.
  2. verify V = [anchor, y1, c2..c5] (y1 the target's greedy token, c the round-1 chain) at
     12..17; a accepted; pairs P = 11..11+a with tokens V[0..a] and g[11..11+a]; seed
     (bonus, g[12+a]) at 12+a; chain.
Stored per round: the new raw feature rows [rows, 192] and their first position, the seed token,
the chain tokens, the draft-vocabulary logits of each chain step [5, 64] (f32 base64),
nmse_f32_vs_f64.
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

AUX = [1, 3, 2]
DRAFT_VOCAB = 64
CHAIN = 5
PROMPT = [1, 17, 42, 255, 0, 99, 128, 7, 42, 17, 200, 63]
THETA = 10000.0


def b64(np, a):
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def d2t_ids():
    return [4 * i + (i % 4) for i in range(DRAFT_VOCAB)]


def head_tensors(np, case):
    e, f = H.N_EMBD, H.N_FF
    q, kv = H.N_HEAD * H.HEAD_DIM, H.N_HEAD_KV * H.HEAD_DIM
    shapes = {
        "fc.weight": (e, 3 * e), "lm_head.weight": (DRAFT_VOCAB, e),
        "midlayer.hidden_norm.weight": (e,), "midlayer.input_layernorm.weight": (e,),
        "midlayer.mlp.down_proj.weight": (e, f), "midlayer.mlp.gate_proj.weight": (f, e),
        "midlayer.mlp.up_proj.weight": (f, e), "midlayer.post_attention_layernorm.weight": (e,),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * e), "midlayer.self_attn.o_proj.weight": (e, q),
        "midlayer.self_attn.q_proj.weight": (q, 2 * e), "midlayer.self_attn.v_proj.weight": (kv, 2 * e),
        "norm.weight": (e,),
    }
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
        out[name] = H.tensor_values(np, t + 2000 + 100 * case, shapes[name], s)
    return out


GGUF = {"fc.weight": "fc.weight", "lm_head.weight": "output.weight", "norm.weight": "output_norm.weight",
        "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
        "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
        "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight"}


def write_head_gguf(gguf, np, path, w, name, nbr):
    g = gguf.GGUFWriter(str(path), "eagle3")
    a = "eagle3"
    g.add_string("general.type", "model")
    g.add_string("general.name", f"specula-eagle3-tiny-{name}")
    g.add_uint32(f"{a}.block_count", 1)
    g.add_uint32(f"{a}.context_length", H.N_CTX)
    g.add_uint32(f"{a}.embedding_length", H.N_EMBD)
    g.add_uint32(f"{a}.feed_forward_length", H.N_FF)
    g.add_uint32(f"{a}.attention.head_count", H.N_HEAD)
    g.add_uint32(f"{a}.attention.head_count_kv", H.N_HEAD_KV)
    g.add_float32(f"{a}.rope.freq_base", THETA)
    g.add_float32(f"{a}.attention.layer_norm_rms_epsilon", H.RMS_EPS)
    g.add_uint32("general.file_type", 0)
    g.add_uint32(f"{a}.vocab_size", H.N_VOCAB)
    g.add_uint32(f"{a}.rope.dimension_count", H.HEAD_DIM)
    g.add_array(f"{a}.target_layers", AUX)
    g.add_uint32(f"{a}.target_hidden_size", H.N_EMBD)
    g.add_bool(f"{a}.norm_before_residual", nbr)
    g.add_bool(f"{a}.norm_before_fc", False)
    g.add_string("tokenizer.ggml.model", "gpt2")
    g.add_string("tokenizer.ggml.pre", "default")
    g.add_array("tokenizer.ggml.tokens", H.byte_symbols())
    g.add_array("tokenizer.ggml.token_type", [1] * H.N_VOCAB)
    g.add_array("tokenizer.ggml.merges", H.MERGES)
    g.add_uint32("tokenizer.ggml.bos_token_id", 0)
    g.add_uint32("tokenizer.ggml.eos_token_id", 0)
    g.add_uint32("general.quantization_version", 2)
    for hf in sorted(w):
        data = w[hf]
        if hf.endswith("q_proj.weight"):
            data = H.permute(data, H.N_HEAD)
        elif hf.endswith("k_proj.weight"):
            data = H.permute(data, H.N_HEAD_KV)
        g.add_tensor(GGUF[hf], np.ascontiguousarray(data))
    g.add_tensor("d2t", np.array(d2t_ids(), dtype=np.int64))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


class Eagle3Ref:
    def __init__(self, torch, w, embed, nbr, dtype):
        self.t, self.dtype, self.nbr = torch, dtype, nbr
        self.w = {k: torch.from_numpy(v.copy()).to(dtype) for k, v in w.items()}
        self.embed = embed.to(dtype)
        self.k = None  # [kv_heads, len, d]
        self.v = None

    def rms(self, x, w):
        return x * self.t.rsqrt(x.pow(2).mean(-1, keepdim=True) + H.RMS_EPS) * w

    def rope(self, x, pos):
        t, d = self.t, H.HEAD_DIM
        inv = 1.0 / (THETA ** (t.arange(0, d, 2, dtype=t.float64) / d))
        ang = t.tensor(pos, dtype=t.float64)[:, None] * inv[None, :]
        emb = t.cat([ang, ang], -1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return x * cos + t.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    def encode(self, feats):
        return feats.to(self.dtype) @ self.w["fc.weight"].T

    def decode(self, tokens, g, pos):
        """Rows at positions pos (appended to the cache, which must end at pos[0])."""
        t, w = self.t, self.w
        hd, nh, nkv = H.HEAD_DIM, H.N_HEAD, H.N_HEAD_KV
        n = len(tokens)
        p = lambda s: w[f"midlayer.{s}"]  # noqa: E731
        en = self.rms(self.embed[t.tensor(tokens)], p("input_layernorm.weight"))
        gn = self.rms(g, p("hidden_norm.weight"))
        x = t.cat([en, gn], -1)
        q = self.rope((x @ p("self_attn.q_proj.weight").T).view(n, nh, hd).transpose(0, 1), pos)
        k = self.rope((x @ p("self_attn.k_proj.weight").T).view(n, nkv, hd).transpose(0, 1), pos)
        v = (x @ p("self_attn.v_proj.weight").T).view(n, nkv, hd).transpose(0, 1)
        if self.k is not None:
            assert self.k.shape[1] == pos[0], (self.k.shape, pos)
            k, v = t.cat([self.k, k], 1), t.cat([self.v, v], 1)
        self.k, self.v = k, v
        kk, vv = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        L = kk.shape[1]
        qpos = t.tensor(pos)[:, None]
        kpos = t.arange(L)[None, :]
        s = (q @ kk.transpose(1, 2)) * hd ** -0.5
        s = s.masked_fill(kpos > qpos, float("-inf"))
        o = (t.softmax(s, -1) @ vv).transpose(0, 1).reshape(n, nh * hd)
        h = o @ p("self_attn.o_proj.weight").T + (gn if self.nbr else g)
        m = self.rms(h, p("post_attention_layernorm.weight"))
        h = h + (t.nn.functional.silu(m @ p("mlp.gate_proj.weight").T) * (m @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        logits = self.rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
        return logits, h

    def crop(self, length):
        self.k, self.v = self.k[:, :length], self.v[:, :length]


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
        print(f"eagle3_golden.py: skipped ({e}); golden/eagle3 unchanged")
        return 0
    from transformers import DynamicCache

    H.N_LAYER = 4
    cfg, target, ttensors = H.build(np, torch, transformers, "qwen3")
    keep = Path(args.keep_gguf) if args.keep_gguf else Path(tempfile.mkdtemp())
    keep.mkdir(parents=True, exist_ok=True)
    embed = target.model.embed_tokens.weight.detach()
    d2t = d2t_ids()

    def feats(hs):
        return torch.cat([hs[i][0] for i in AUX], -1)

    def nmse(a, b):
        a, b = a.double(), b.double()
        return float(((a - b) ** 2).sum() / (b ** 2).sum())

    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        out = target(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True,
                     output_hidden_states=True)
        f1 = feats(out.hidden_states)
        anchor = int(out.logits[0, -1].argmax())
        c2 = DynamicCache(config=cfg)
        target(torch.tensor([PROMPT]), past_key_values=c2, use_cache=True)
        y1 = int(target(torch.tensor([[anchor]]), past_key_values=c2, use_cache=True,
                        position_ids=torch.tensor([[12]])).logits[0, -1].argmax())

    cases = []
    for ci, (name, nbr) in enumerate([("plain", False), ("nbr", True)]):
        w = head_tensors(np, ci)
        path = keep / f"eagle3-{name}.gguf"
        write_head_gguf(gguf, np, path, w, name, nbr)
        heads = {dt: Eagle3Ref(torch, w, embed, nbr, dt) for dt in (torch.float32, torch.float64)}

        def chain(dt, seed_tok, g_seed, pos0):
            head, toks, logits = heads[dt], [], []
            tok, g = seed_tok, g_seed
            for step in range(CHAIN):
                lg, pre = head.decode([tok], g, [pos0 + step])
                logits.append(lg[0])
                tok = d2t[int(lg[0].argmax())]
                toks.append(tok)
                g = pre
            head.crop(pos0)
            return toks, torch.stack(logits)

        rounds = []
        with torch.no_grad():
            res = {}
            for dt, head in heads.items():
                g = head.encode(f1)
                head.decode(PROMPT[1:], g[:11], list(range(11)))
                res[dt] = chain(dt, anchor, g[11:12], 11)
            toks1, lg1 = res[torch.float32]
            rounds.append({"ctx_pos0": 0, "ctx_features": b64(np, f1.numpy()), "ctx_rows": 12,
                           "seed": anchor, "seed_pos": 11, "chain": toks1,
                           "logits": b64(np, lg1.numpy()),
                           "nmse_f32_vs_f64": nmse(lg1, res[torch.float64][1])})
            verify = [anchor, y1] + toks1[1:]
            vc = DynamicCache(config=cfg)
            target(torch.tensor([PROMPT]), past_key_values=vc, use_cache=True)
            vout = target(torch.tensor([verify]), past_key_values=vc, use_cache=True,
                          output_hidden_states=True, position_ids=torch.tensor([list(range(12, 18))]))
            post = vout.logits[0].argmax(-1).tolist()
            a = 0
            while a < len(verify) - 1 and verify[a + 1] == post[a]:
                a += 1
            assert a >= 1
            bonus = post[a]
            f2 = feats(vout.hidden_states)[: a + 1]
            res = {}
            for dt, head in heads.items():
                g1 = head.encode(f1)
                g2 = head.encode(f2)
                gall = torch.cat([g1, g2], 0)  # positions 0..12+a
                head.decode(verify[: a + 1], gall[11:12 + a], list(range(11, 12 + a)))
                res[dt] = chain(dt, bonus, gall[12 + a:13 + a], 12 + a)
            toks2, lg2 = res[torch.float32]
            rounds.append({"ctx_pos0": 12, "ctx_features": b64(np, f2.numpy()), "ctx_rows": a + 1,
                           "verify": verify, "accepted": a, "seed": bonus, "seed_pos": 12 + a,
                           "chain": toks2, "logits": b64(np, lg2.numpy()),
                           "nmse_f32_vs_f64": nmse(lg2, res[torch.float64][1])})
        cases.append({"name": name, "norm_before_residual": nbr,
                      "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rounds": rounds})
        print(f"{name}: chain 1 {toks1}, accepted {a}, chain 2 {toks2}")

    doc = {"producer": "reference/eagle3_golden.py", "torch": torch.__version__,
           "transformers": transformers.__version__, "prompt": PROMPT, "d2t": d2t,
           "cases": cases}
    out_dir = Path(args.out) / "eagle3"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tiny.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out_dir / 'tiny.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
