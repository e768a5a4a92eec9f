//! Test support: a tiny random llama GGUF built in memory (as in `specula-engine`'s tests,
//! plus a chat template), tiny random DFlash / DFlash2 drafters and an EAGLE-3 head for it
//! (as in `specula-engine`'s `tests/dflash.rs`), a server on loopback around it, and a minimal
//! blocking HTTP/1.1 client that reads JSON and SSE answers.

#![allow(
    dead_code,
    reason = "each test binary uses a part of the support module"
)]

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use specula_cpu::CpuBackend;
use specula_engine::{DflashDrafter, DraftModel, Eagle3Drafter, Engine, Injection, SpecOptions};
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value as GValue};
use specula_models::Model;
use specula_models::dflash::Dflash;
use specula_models::eagle3::Eagle3;
use specula_quant::QType;
use specula_server::{ServerConfig, ServerHandle, Speculative};
use specula_spec::ngram::NgramSimple;
use specula_testkit::{byte_symbols, values};
use specula_tokenizer::Tokenizer;

/// A ChatML-like template.
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

const N_VOCAB: usize = 256;
const N_EMBD: usize = 64;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = 16;
const N_LAYER: usize = 2;

/// A tiny llama GGUF (with a chat template) with random weights (`seed`), its end-of-generation token `eos` and,
/// when `rename` is set, token 7 renamed (to test the vocabulary check).
pub fn tiny(seed: u64, eos: u32, rename: bool) -> Vec<u8> {
    tiny_heads(seed, eos, rename, HEAD_DIM)
}

/// [`tiny`] with heads of `head_dim` values (the block cache formats need a multiple of 32,
/// their Hadamard rotation a multiple of 64).
pub fn tiny_heads(seed: u64, eos: u32, rename: bool, head_dim: usize) -> Vec<u8> {
    let u = |v: usize| GValue::U32(u32::try_from(v).unwrap());
    let mut w = GgufWriter::new();
    let mut tokens = byte_symbols();
    if rename {
        tokens[7] = "renamed".into();
    }
    let md: Vec<(&str, GValue)> = vec![
        ("general.architecture", GValue::String("llama".into())),
        ("llama.block_count", u(N_LAYER)),
        ("llama.context_length", u(512)),
        ("llama.embedding_length", u(N_EMBD)),
        ("llama.feed_forward_length", u(N_FF)),
        ("llama.attention.head_count", u(N_HEAD)),
        ("llama.attention.head_count_kv", u(N_HEAD_KV)),
        ("llama.rope.freq_base", GValue::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", GValue::F32(1e-5)),
        ("llama.rope.dimension_count", u(head_dim)),
        ("llama.vocab_size", u(N_VOCAB)),
        ("tokenizer.ggml.model", GValue::String("gpt2".into())),
        ("tokenizer.ggml.pre", GValue::String("default".into())),
        (
            "tokenizer.ggml.tokens",
            GValue::Array(Array::String(tokens)),
        ),
        (
            "tokenizer.ggml.token_type",
            GValue::Array(Array::I32(vec![1; N_VOCAB])),
        ),
        (
            "tokenizer.ggml.merges",
            GValue::Array(Array::String(vec!["a b".into()])),
        ),
        ("tokenizer.ggml.bos_token_id", GValue::U32(1)),
        ("tokenizer.ggml.eos_token_id", GValue::U32(eos)),
        ("tokenizer.ggml.add_bos_token", GValue::Bool(false)),
        (
            "tokenizer.chat_template",
            GValue::String(CHAT_TEMPLATE.into()),
        ),
    ];
    for (k, v) in md {
        w.add(k, v).unwrap();
    }
    if head_dim != N_EMBD / N_HEAD {
        w.add("llama.attention.key_length", u(head_dim)).unwrap();
        w.add("llama.attention.value_length", u(head_dim)).unwrap();
    }
    let (q, kv) = (N_HEAD * head_dim, N_HEAD_KV * head_dim);
    let mut t: Vec<(String, QType, usize, usize)> = vec![
        ("token_embd.weight".into(), QType::Q8_0, N_EMBD, N_VOCAB),
        ("output_norm.weight".into(), QType::F32, N_EMBD, 1),
        ("output.weight".into(), QType::Q8_0, N_EMBD, N_VOCAB),
    ];
    for l in 0..N_LAYER {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.extend([
            (n("attn_norm.weight"), QType::F32, N_EMBD, 1),
            (n("ffn_norm.weight"), QType::F32, N_EMBD, 1),
            (n("attn_q.weight"), QType::Q8_0, N_EMBD, q),
            (n("attn_k.weight"), QType::Q4_0, N_EMBD, kv),
            (n("attn_v.weight"), QType::Q8_0, N_EMBD, kv),
            (n("attn_output.weight"), QType::Q4_0, q, N_EMBD),
            (n("ffn_gate.weight"), QType::Q4_0, N_EMBD, N_FF),
            (n("ffn_up.weight"), QType::Q8_0, N_EMBD, N_FF),
            (n("ffn_down.weight"), QType::Q4_0, N_FF, N_EMBD),
        ]);
    }
    let mut data = Vec::new();
    for (i, (name, ty, n_in, n_out)) in t.iter().enumerate() {
        let vector = *n_out == 1;
        let dims: Vec<u64> = if vector {
            vec![*n_in as u64]
        } else {
            vec![*n_in as u64, *n_out as u64]
        };
        let ggml = GgmlType::from_id(ty.ggml_id().unwrap()).unwrap();
        w.add_tensor(name.as_str(), ggml, &dims).unwrap();
        let x = if vector {
            values(seed + i as u64, *n_in, 0.2)
                .iter()
                .map(|v| 1.0 + v)
                .collect()
        } else {
            values(seed + i as u64, n_in * n_out, 0.6)
        };
        let rb = ty.row_bytes(*n_in).unwrap();
        let mut bytes = vec![0u8; rb * n_out];
        for (row, b) in x.chunks_exact(*n_in).zip(bytes.chunks_exact_mut(rb)) {
            specula_quant::quantize_row(*ty, row, b).unwrap();
        }
        data.push(bytes);
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&refs).unwrap()
}

pub fn engine(bytes: Vec<u8>) -> Engine<CpuBackend> {
    let file = Arc::new(Gguf::from_bytes(bytes).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let be = CpuBackend::new(2);
    let model = Model::load(&be, file).unwrap();
    Engine::new(be, model, tokenizer)
}

/// The seed of the tiny target.
pub const SEED: u64 = 11;

/// A tensor of a drafter file: name, type, ggml dims, values.
type T = (String, QType, Vec<usize>, Vec<f32>);

fn write(md: Vec<(String, GValue)>, tensors: &[T]) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in md {
        w.add(k, v).unwrap();
    }
    let mut data = Vec::new();
    for (name, ty, dims, x) in tensors {
        let d: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        w.add_tensor(
            name.as_str(),
            GgmlType::from_id(ty.ggml_id().unwrap()).unwrap(),
            &d,
        )
        .unwrap();
        let rb = ty.row_bytes(dims[0]).unwrap();
        let mut bytes = vec![0u8; rb * (x.len() / dims[0])];
        for (row, b) in x.chunks_exact(dims[0]).zip(bytes.chunks_exact_mut(rb)) {
            specula_quant::quantize_row(*ty, row, b).unwrap();
        }
        data.push(bytes);
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&refs).unwrap()
}

/// The shape metadata of a drafter of the tiny target's width.
fn drafter_md(arch: &str, n_layer: usize) -> Vec<(String, GValue)> {
    let u = |v: usize| GValue::U32(u32::try_from(v).unwrap());
    let k = |s: &str| format!("{arch}.{s}");
    vec![
        ("general.architecture".into(), GValue::String(arch.into())),
        (k("block_count"), u(n_layer)),
        (k("context_length"), u(512)),
        (k("embedding_length"), u(N_EMBD)),
        (k("feed_forward_length"), u(N_FF)),
        (k("attention.head_count"), u(N_HEAD)),
        (k("attention.head_count_kv"), u(N_HEAD_KV)),
        (k("rope.freq_base"), GValue::F32(10_000.0)),
        (k("attention.layer_norm_rms_epsilon"), GValue::F32(1e-5)),
        (k("attention.key_length"), u(HEAD_DIM)),
        (k("attention.value_length"), u(HEAD_DIM)),
    ]
}

/// The block size of the test DFlash drafters (drafts of at most 5 tokens).
pub const DFLASH_BLOCK: usize = 6;
/// The MASK token of the test DFlash drafters.
const MASK: u32 = 255;

/// A random two-layer DFlash drafter (DFlash2 with `dflash2`: convolutions and the candidate
/// selector) for the tiny target, tapping `taps`, block [`DFLASH_BLOCK`].
pub fn dflash(seed: u64, taps: &[i32], dflash2: bool) -> Vec<u8> {
    let u = |v: usize| GValue::U32(u32::try_from(v).unwrap());
    let mut md = drafter_md("dflash", 2);
    md.push(("dflash.block_size".into(), u(DFLASH_BLOCK)));
    md.push((
        "dflash.target_layers".into(),
        GValue::Array(Array::I32(taps.to_vec())),
    ));
    md.push(("tokenizer.ggml.mask_token_id".into(), GValue::U32(MASK)));
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let mut i = seed * 100;
    let mut r = |n: usize, s: f32| {
        i += 1;
        values(i, n, s)
    };
    let norm = |x: Vec<f32>| x.iter().map(|v| 1.0 + v).collect::<Vec<f32>>();
    let vt = |name: String, x: Vec<f32>| (name, QType::F32, vec![x.len()], x);
    let mt = |name: String, n_in: usize, n_out: usize, x: Vec<f32>| {
        (name, QType::F32, vec![n_in, n_out], x)
    };
    let nf = taps.len() * N_EMBD;
    let mut t: Vec<T> = vec![
        mt("fc.weight".into(), nf, N_EMBD, r(nf * N_EMBD, 0.3)),
        vt("enc.output_norm.weight".into(), norm(r(N_EMBD, 0.2))),
        vt("output_norm.weight".into(), norm(r(N_EMBD, 0.2))),
    ];
    for l in 0..2 {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.extend([
            vt(n("attn_norm.weight"), norm(r(N_EMBD, 0.2))),
            vt(n("ffn_norm.weight"), norm(r(N_EMBD, 0.2))),
            vt(n("attn_q_norm.weight"), norm(r(HEAD_DIM, 0.2))),
            vt(n("attn_k_norm.weight"), norm(r(HEAD_DIM, 0.2))),
            mt(n("attn_q.weight"), N_EMBD, q, r(N_EMBD * q, 0.6)),
            mt(n("attn_k.weight"), N_EMBD, kv, r(N_EMBD * kv, 0.6)),
            mt(n("attn_v.weight"), N_EMBD, kv, r(N_EMBD * kv, 0.6)),
            mt(n("attn_output.weight"), q, N_EMBD, r(q * N_EMBD, 0.6)),
            mt(n("ffn_gate.weight"), N_EMBD, N_FF, r(N_EMBD * N_FF, 0.6)),
            mt(n("ffn_up.weight"), N_EMBD, N_FF, r(N_EMBD * N_FF, 0.6)),
            mt(n("ffn_down.weight"), N_FF, N_EMBD, r(N_FF * N_EMBD, 0.6)),
        ]);
    }
    if dflash2 {
        let (kernel, group, rank) = (2usize, 16usize, 8usize);
        let proj = 2 * kernel * (N_EMBD / group);
        for l in 0..2 {
            for c in ["attn", "ffn"] {
                t.push((
                    format!("blk.{l}.{c}_conv_base"),
                    QType::F32,
                    vec![N_EMBD, kernel, 2],
                    r(N_EMBD * kernel * 2, 0.5),
                ));
                t.push(mt(
                    format!("blk.{l}.{c}_conv_proj.weight"),
                    N_EMBD,
                    proj,
                    r(N_EMBD * proj, 0.3),
                ));
            }
        }
        t.push(mt(
            "selector_hidden.weight".into(),
            N_EMBD,
            rank,
            r(N_EMBD * rank, 0.5),
        ));
        for side in ["predecessor", "successor"] {
            t.push(mt(
                format!("selector_{side}.weight"),
                rank,
                N_VOCAB,
                r(rank * N_VOCAB, 1.0),
            ));
        }
        md.extend([
            ("dflash.conv_kernel_size".into(), u(kernel)),
            ("dflash.conv_group_size".into(), u(group)),
            ("dflash.selector_rank".into(), u(rank)),
            ("dflash.selector_top_k".into(), u(4)),
        ]);
    }
    write(md, &t)
}

/// A random EAGLE-3 head for the tiny target (the target's own output head), tapping `taps`.
pub fn eagle3(seed: u64, taps: &[i32]) -> Vec<u8> {
    let mut md = drafter_md("eagle3", 1);
    md.push((
        "eagle3.target_layers".into(),
        GValue::Array(Array::I32(taps.to_vec())),
    ));
    md.push((
        "eagle3.target_hidden_size".into(),
        GValue::U32(u32::try_from(N_EMBD).unwrap()),
    ));
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let mut i = seed * 100;
    let mut r = |n: usize, s: f32| {
        i += 1;
        values(i, n, s)
    };
    let norm = |x: Vec<f32>| x.iter().map(|v| 1.0 + v).collect::<Vec<f32>>();
    let vt = |name: &str, x: Vec<f32>| (name.to_owned(), QType::F32, vec![x.len()], x);
    let mt = |name: &str, n_in: usize, n_out: usize, x: Vec<f32>| {
        (name.to_owned(), QType::F32, vec![n_in, n_out], x)
    };
    let (e, nf) = (N_EMBD, taps.len() * N_EMBD);
    let t: Vec<T> = vec![
        mt("fc.weight", nf, e, r(nf * e, 0.3)),
        vt("output_norm.weight", norm(r(e, 0.2))),
        vt("blk.0.attn_norm.weight", norm(r(e, 0.2))),
        vt("blk.0.attn_norm_2.weight", norm(r(e, 0.2))),
        vt("blk.0.ffn_norm.weight", norm(r(e, 0.2))),
        mt("blk.0.attn_q.weight", 2 * e, q, r(2 * e * q, 0.5)),
        mt("blk.0.attn_k.weight", 2 * e, kv, r(2 * e * kv, 0.5)),
        mt("blk.0.attn_v.weight", 2 * e, kv, r(2 * e * kv, 0.5)),
        mt("blk.0.attn_output.weight", q, e, r(q * e, 0.5)),
        mt("blk.0.ffn_gate.weight", e, N_FF, r(e * N_FF, 0.5)),
        mt("blk.0.ffn_up.weight", e, N_FF, r(e * N_FF, 0.5)),
        mt("blk.0.ffn_down.weight", N_FF, e, r(N_FF * e, 0.5)),
    ];
    write(md, &t)
}

/// Fixed-length drafting (no timing-driven policy), so that two runs draft alike; `p_min`
/// makes a model drafter's draft length follow its own confidence.
pub fn fixed(n_max: usize, p_min: f32) -> SpecOptions {
    SpecOptions {
        n_max,
        n_min: 0,
        p_min,
        adaptive: false,
    }
}

/// Which drafter a test server gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Draft {
    /// No speculation.
    None,
    /// Prompt lookup.
    Ngram,
    /// The target itself as draft model (accepts everything it drafts).
    SelfModel,
    /// A random DFlash drafter ([`dflash`], seed 5, taps `[2, 0]`), deferred or eager
    /// injection, DFlash2 or not, with [`fixed`] options.
    Dflash {
        deferred: bool,
        dflash2: bool,
        options: SpecOptions,
    },
    /// A random EAGLE-3 head ([`eagle3`], seed 9, taps `[0, 1, 2]`) with these options.
    Eagle3 { options: SpecOptions },
}

/// A server on 127.0.0.1 (free port) around the tiny model.
pub fn server(cfg: ServerConfig, draft: Draft) -> ServerHandle {
    server_with(cfg, draft, 512)
}

/// [`server`] with a prompt chunk of `n_batch` tokens.
pub fn server_with(cfg: ServerConfig, draft: Draft, n_batch: usize) -> ServerHandle {
    server_on(tiny(SEED, 0, false), cfg, draft, n_batch)
}

/// [`server_with`] around the model file `bytes` (the drafters are made for [`tiny`]'s shape).
pub fn server_on(bytes: Vec<u8>, cfg: ServerConfig, draft: Draft, n_batch: usize) -> ServerHandle {
    let mut e = engine(bytes.clone());
    e.n_batch = n_batch;
    let tok = Tokenizer::from_gguf(&Gguf::from_bytes(bytes.clone()).unwrap()).unwrap();
    let n_ctx_slot = cfg.n_ctx / cfg.n_parallel;
    let spec = match draft {
        Draft::None => None,
        Draft::Ngram => Some(ngram()),
        Draft::SelfModel => {
            let d = Arc::new(engine(bytes.clone()));
            let target = Tokenizer::from_gguf(&Gguf::from_bytes(bytes).unwrap()).unwrap();
            Some(Speculative {
                kind: "draft-simple".into(),
                options: SpecOptions {
                    n_max: 6,
                    n_min: 0,
                    p_min: 0.0,
                    adaptive: false,
                },
                factory: Box::new(move || {
                    DraftModel::shared(Arc::clone(&d), &target, n_ctx_slot, QType::F16, QType::F16)
                        .map(|m| Box::new(m) as _)
                        .map_err(|e| Box::new(e) as _)
                }),
            })
        }
        Draft::Dflash {
            deferred,
            dflash2,
            options,
        } => {
            // One network for every slot, as `specula serve` loads it.
            let be = CpuBackend::new(1);
            let file = Arc::new(Gguf::from_bytes(dflash(5, &[2, 0], dflash2)).unwrap());
            let net = Arc::new(Dflash::load(&be, file, &e.model).unwrap());
            let be = Arc::new(be);
            let policy = if deferred {
                Injection::Deferred
            } else {
                Injection::Eager
            };
            Some(Speculative {
                kind: "draft-dflash".into(),
                options,
                factory: Box::new(move || {
                    DflashDrafter::shared(
                        Arc::clone(&be),
                        Arc::clone(&net),
                        n_ctx_slot,
                        QType::F16,
                        QType::F16,
                        policy,
                    )
                    .map(|d| Box::new(d) as _)
                    .map_err(|e| Box::new(e) as _)
                }),
            })
        }
        Draft::Eagle3 { options } => {
            let be = CpuBackend::new(1);
            let file = Arc::new(Gguf::from_bytes(eagle3(9, &[0, 1, 2])).unwrap());
            let net = Arc::new(Eagle3::load(&be, file, &e.model).unwrap());
            let be = Arc::new(be);
            Some(Speculative {
                kind: "draft-eagle3".into(),
                options,
                factory: Box::new(move || {
                    Eagle3Drafter::shared(
                        Arc::clone(&be),
                        Arc::clone(&net),
                        n_ctx_slot,
                        QType::F16,
                        QType::F16,
                    )
                    .map(|d| Box::new(d) as _)
                    .map_err(|e| Box::new(e) as _)
                }),
            })
        }
    };
    start(cfg, e, tok, spec)
}

/// A server on 127.0.0.1 (free port) around the tiny model with the speculative setup `spec`.
pub fn server_spec(cfg: ServerConfig, spec: Option<Speculative>) -> ServerHandle {
    let bytes = tiny(SEED, 0, false);
    let tok = Tokenizer::from_gguf(&Gguf::from_bytes(bytes.clone()).unwrap()).unwrap();
    start(cfg, engine(bytes), tok, spec)
}

fn start(
    cfg: ServerConfig,
    e: Engine<CpuBackend>,
    tok: Tokenizer,
    spec: Option<Speculative>,
) -> ServerHandle {
    specula_server::start(
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            ..cfg
        },
        e,
        tok,
        spec,
    )
    .unwrap()
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| {
                ev.lines()
                    .find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                    .map(str::to_owned)
            })
            .collect()
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(
            std::str::from_utf8(&b[..eol])
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .trim(),
            16,
        )
        .unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

/// Writes a request and returns the open connection.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // A large body may be refused before it is all read: the answer still comes.
    let _ = s.write_all(body);
    s
}

/// One request, the whole answer.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut s = send(addr, method, path, headers, body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = &raw[split + 4..];
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Resp { status, head, body }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

/// A streamed answer: the concatenated text, the token ids, the final chunk.
#[derive(Debug)]
pub struct Streamed {
    pub text: String,
    pub tokens: Vec<u64>,
    pub last: Value,
    pub done: bool,
}

pub fn streamed(r: &Resp) -> Streamed {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut out = Streamed {
        text: String::new(),
        tokens: Vec::new(),
        last: Value::Null,
        done: false,
    };
    for d in r.sse() {
        if d == "[DONE]" {
            out.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"]
            .as_str()
            .or_else(|| c["text"].as_str())
        {
            out.text.push_str(t);
        }
        if let Some(ts) = v["tokens"].as_array() {
            out.tokens.extend(ts.iter().map(|t| t.as_u64().unwrap()));
        }
        out.last = v;
    }
    out
}

/// The value of an unlabelled metric.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
        .parse()
        .unwrap()
}

/// A server on the real model file `path` (two CPU threads) with `tune` applied to its engine
/// first; `cfg`'s port is taken as 0 (any free one).
pub fn real_server_tuned(
    path: &Path,
    cfg: ServerConfig,
    spec: Option<Speculative>,
    tune: impl FnOnce(&mut Engine<CpuBackend>),
) -> ServerHandle {
    let file = Arc::new(Gguf::open(path).unwrap());
    let be = CpuBackend::new(2);
    let model = Model::load(&be, Arc::clone(&file)).unwrap();
    let mut engine = Engine::new(be, model, Tokenizer::from_gguf(&file).unwrap());
    tune(&mut engine);
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let cfg = ServerConfig { port: 0, ..cfg };
    specula_server::start(cfg, engine, tok, spec).unwrap()
}

/// [`real_server_tuned`] with the engine as loaded.
pub fn real_server(path: &Path, cfg: ServerConfig, spec: Option<Speculative>) -> ServerHandle {
    real_server_tuned(path, cfg, spec, |_| {})
}

/// [`real_server`] on the fetched real model `name` (`specula_testkit::real_model`); `None`
/// when it has not been fetched (the test skips).
pub fn real(name: &str, cfg: ServerConfig, spec: Option<Speculative>) -> Option<ServerHandle> {
    let path = specula_testkit::real_model(name)?;
    Some(real_server(&path, cfg, spec))
}

/// An `ngram-simple` drafter with the default options.
pub fn ngram() -> Speculative {
    Speculative {
        kind: "ngram-simple".into(),
        options: SpecOptions::default(),
        factory: Box::new(|| Ok(Box::new(NgramSimple::default()) as _)),
    }
}

/// The fixture `golden/<dir>/<name>.json` of the repository.
pub fn golden(dir: &str, name: &str) -> Value {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden")
        .join(dir)
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The keys of a JSON object, sorted.
pub fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect();
    k.sort();
    k
}

/// Greedy tokens of specula (`ours`) and llama-server (`theirs`) for `body` sent to `path`:
/// equal, or equal up to a step where the two best logits are a near tie (the kernels'
/// rounding differs: llama.cpp's quantized dot products quantize activations to Q8_1), where
/// llama-server's pick is specula's runner-up within `TIE` nats (asked again of `path` with
/// `n_probs` 2, not streamed). Returns that step, `None` when equal throughout.
pub fn greedy_agrees(
    s: &ServerHandle,
    path: &str,
    name: &str,
    body: &Value,
    ours: &[Value],
    theirs: &[Value],
) -> Option<usize> {
    /// The widest log-probability gap between the two best tokens still taken as a tie.
    const TIE: f64 = 0.05;
    let Some(d) = ours.iter().zip(theirs).position(|(a, b)| a != b) else {
        assert_eq!(ours.len(), theirs.len(), "{name}: number of tokens");
        return None;
    };
    let mut probe = body.clone();
    probe["n_probs"] = 2.into();
    if probe.get("stream").is_some() {
        probe["stream"] = false.into();
    }
    let v = post(s.addr(), path, &probe).json();
    let step = &v["completion_probabilities"][d];
    let top = step["top_logprobs"].as_array().unwrap();
    let lp = |i: usize| top[i]["logprob"].as_f64().unwrap();
    let gap = lp(0) - lp(1);
    assert!(
        gap < TIE && step["id"] == ours[d],
        "{name}: greedy tokens differ at step {d} ({} here, {} in llama-server) and the top two logprobs are {gap} nats apart: {step}",
        ours[d],
        theirs[d]
    );
    eprintln!("{name}: greedy output equal for {d} tokens, then a near tie ({gap:.4} nats)");
    Some(d)
}
