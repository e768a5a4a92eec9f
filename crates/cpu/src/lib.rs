//! The CPU backend: [`specula_tensor::Backend`] on host memory, with a persistent thread pool.
//!
//! - [`CpuBackend`] — the backend; [`CpuBackend::new`] starts its threads once.
//! - [`CpuTensor`] — an f32 activation matrix `[rows, cols]` whose storage is reused on resize.
//! - [`CpuWeight`] — a weight in its GGUF block format, borrowed from the model file's memory;
//!   only vectors (norm weights, biases) are converted to f32, once, at load.
//! - [`CpuKv`] — the KV cache: K and V each in any format of [`specula_kv::CACHE_TYPES`]
//!   (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, turbo2/3/4), quantized on write.
//!
//! Where the work is done:
//!
//! | module | ops |
//! |---|---|
//! | `matmul`, `gemm` | `matmul`: activations quantized to the weight's `vec_dot_type`, tiles of dot products with the bits of [`specula_quant::dot`] (AVX-512 micro-kernels for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K) |
//! | `ops` | `copy_rows`, `get_rows`, `add_vector`, `rms_norm`, `rms_norm_groups`, `swiglu`, `geglu`, `add`, `scale` |
//! | `rope` | `rope` (normal and NeoX pairing, partial rotation, linear scaling, YaRN) as ggml-cpu computes it |
//! | `attention` | the cache, `kv_write` (quantizing set_rows), flash `attention` over every cache format (online softmax, key tiles, GQA, causal / sliding-window / no mask, soft cap, turbo rotation of Q and of the output); `attention::simd` its inner loops |
//! | `pool` | the thread pool and the static split of work |
//!
//! **Batch invariance.** Every output value is reduced by one thread, in one fixed order, by
//! code that does not look at the batch size or the thread count: a row computed alone, in a
//! batch of 17 or on 3 threads gives the same bits (tested for every op in `tests/`). Results
//! may differ between instruction sets ([`CpuBackend::with_simd`]) for float dot products; for
//! quantized weights they are the bits of the scalar reference on every instruction set.
//!
//! **Numerics follow ggml-cpu** where it matters for tracking llama.cpp's logits: RMS norm sums
//! squares in f64 (`1/sqrt(mean + eps)`), RoPE builds its angles with the same f32 recurrence,
//! SiLU is `x/(1 + e^−x)`, GELU the tanh form (computed in f32, without ggml-cpu's f16 table).
//!
//! NVFP4 weights carry a per-tensor scale outside their blocks; `matmul` does not apply it, the
//! model multiplies the output by it.
//!
//! ```
//! use std::sync::Arc;
//! use specula_cpu::CpuBackend;
//! use specula_tensor::{Backend, QType, WeightDesc};
//!
//! let be = CpuBackend::new(2);
//! // A 2 × 32 F32 weight: row 0 is all ones, row 1 all twos.
//! let w: Vec<u8> = (0..64).flat_map(|i| (if i < 32 { 1.0f32 } else { 2.0 }).to_le_bytes()).collect();
//! let owner = Arc::new(w.clone());
//! let w = be.weight(WeightDesc {
//!     name: "w",
//!     ty: QType::F32,
//!     dims: &[32, 2],
//!     data: &owner[..],
//!     owner: owner.clone(),
//! })?;
//! let x = be.from_host(1, 32, &[0.5; 32]);
//! let mut y = be.zeros(1, 2);
//! be.matmul(&x, &w, &mut y);
//! let mut host = Vec::new();
//! be.to_host(&y, &mut host);
//! assert_eq!(host, [16.0, 32.0]);
//! # Ok::<(), specula_tensor::TensorError>(())
//! ```

mod attention;
mod gemm;
mod matmul;
mod moe;
mod ops;
mod pool;
mod recurrent;
mod rope;
mod scratch;
mod tensor;

use std::sync::{Mutex, MutexGuard, PoisonError};

use specula_quant::dot::{Kernels, SimdLevel};
use specula_tensor::{
    AttentionParams, Backend, KvShape, Result, RopeConfig, SeqAttention, WeightDesc,
};

pub use attention::CpuKv;
/// The softmax's `e^x` (glibc's `__expf_fma` operations) and its constants, for backends that
/// reproduce the CPU attention's bits.
pub use attention::expf;
pub use moe::CpuRoutes;
pub use ops::{gelu_tanh, gelu_tanh_f16, silu};
pub use rope::angle_table;
pub use tensor::{CpuIndex, CpuTensor, CpuWeight};

/// Values per thread below which a row-wise op runs on the calling thread alone.
const ROWS_PARALLEL_MIN: usize = 32 * 1024;

/// The CPU backend.
pub struct CpuBackend {
    pool: pool::Pool,
    kernels: &'static Kernels,
    attn: attention::simd::AttnKernels,
    /// Quantized activation rows of the current matmul.
    act: Mutex<Vec<u8>>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("n_threads", &self.n_threads())
            .field("simd", &self.kernels.level())
            .finish_non_exhaustive()
    }
}

impl CpuBackend {
    /// A backend running on `n_threads` threads (the calling thread included; 0 means one per
    /// available CPU), with the fastest dot-product kernels this CPU supports
    /// ([`Kernels::active`]).
    #[must_use]
    pub fn new(n_threads: usize) -> Self {
        Self::with_simd(n_threads, None)
    }

    /// As [`CpuBackend::new`], with the dot-product kernels of `level` when this CPU supports
    /// it (for comparing levels; `None` or an unsupported level gives the active table).
    #[must_use]
    pub fn with_simd(n_threads: usize, level: Option<SimdLevel>) -> Self {
        let n_threads = if n_threads == 0 {
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
        } else {
            n_threads
        };
        let kernels = matmul::kernels_for(level);
        Self {
            pool: pool::Pool::new(n_threads),
            kernels,
            attn: attention::simd::AttnKernels::for_level(kernels.level()),
            act: Mutex::new(Vec::new()),
        }
    }

    /// Threads, the calling thread included.
    #[must_use]
    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// The SIMD level of the dot-product kernels in use.
    #[must_use]
    pub fn simd_level(&self) -> SimdLevel {
        self.kernels.level()
    }

    pub(crate) fn kernels(&self) -> &'static Kernels {
        self.kernels
    }

    /// The vector path of the element-wise activations: the backend's SIMD level where this
    /// CPU has its features (AVX-512 F; AVX2 with FMA), else none.
    pub(crate) fn simd_act(&self) -> ops::ActSimd {
        #[cfg(target_arch = "x86_64")]
        {
            let level = self.kernels.level();
            if level == SimdLevel::Avx512 && is_x86_feature_detected!("avx512f") {
                return ops::ActSimd::Avx512;
            }
            if matches!(level, SimdLevel::Avx512 | SimdLevel::Avx2)
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
            {
                return ops::ActSimd::Avx2;
            }
        }
        ops::ActSimd::None
    }

    pub(crate) fn attn_kernels(&self) -> attention::simd::AttnKernels {
        self.attn
    }

    pub(crate) fn pool(&self) -> &pool::Pool {
        &self.pool
    }

    /// The buffer for quantized activations (held for the length of one matmul).
    pub(crate) fn scratch(&self) -> MutexGuard<'_, Vec<u8>> {
        self.act.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f(r, row)` on every `cols`-value row of `data`, split over the threads when the
    /// op is large enough to gain from it.
    pub(crate) fn par_rows(
        &self,
        data: &mut [f32],
        cols: usize,
        f: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        if cols == 0 {
            return;
        }
        let rows = data.len() / cols;
        let nth = self.n_threads();
        if nth == 1 || rows < 2 || data.len() < ROWS_PARALLEL_MIN * 2 {
            for (r, row) in data.chunks_exact_mut(cols).enumerate() {
                f(r, row);
            }
            return;
        }
        let nth = nth.min(rows);
        let dst = pool::Disjoint::new(data);
        self.pool.run(&|t| {
            if t >= nth {
                return;
            }
            let mine = pool::split(rows, nth, t);
            // SAFETY: thread t takes only the rows `split(rows, nth, t)`, disjoint from every
            // other thread's.
            let d = unsafe { dst.slice(mine.start * cols..mine.end * cols) };
            for (r, row) in mine.zip(d.chunks_exact_mut(cols)) {
                f(r, row);
            }
        });
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    type Index = CpuIndex;
    type Routes = CpuRoutes;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn weight(&self, desc: WeightDesc<'_>) -> Result<CpuWeight> {
        CpuWeight::from_desc(desc)
    }

    fn prepare_matmul(&self, w: &mut CpuWeight) {
        if let Some(p) = gemm::packing(self.kernels(), w.ty()) {
            w.pack(p, &self.pool);
        }
    }

    fn zeros(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor::zeros(rows, cols)
    }

    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CpuTensor {
        CpuTensor::new(rows, cols, data.to_vec())
    }

    fn to_host(&self, t: &CpuTensor, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(t.as_slice());
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows(), t.cols())
    }

    fn index(&self, v: &[u32]) -> CpuIndex {
        CpuIndex::new(v)
    }

    fn set_index(&self, i: &mut CpuIndex, v: &[u32]) {
        i.set(v);
    }

    fn index_len(&self, i: &CpuIndex) -> usize {
        i.as_u32().len()
    }

    fn argmax_rows(&self, x: &CpuTensor, out: &mut Vec<u32>) {
        out.clear();
        let cols = x.cols().max(1);
        out.extend(
            x.as_slice()
                .chunks_exact(cols)
                .take(x.rows())
                .map(specula_tensor::argmax_row),
        );
    }

    fn top1_rows(&self, x: &CpuTensor, ids: &mut Vec<u32>, probs: &mut Vec<f32>) {
        ids.clear();
        probs.clear();
        let cols = x.cols().max(1);
        for row in x.as_slice().chunks_exact(cols).take(x.rows()) {
            let (id, p) = specula_tensor::top1_row(row);
            ids.push(id);
            probs.push(p);
        }
    }

    fn topk_rows(&self, x: &CpuTensor, k: usize, ids: &mut Vec<u32>, vals: &mut Vec<f32>) {
        ids.clear();
        vals.clear();
        let cols = x.cols().max(1);
        for row in x.as_slice().chunks_exact(cols).take(x.rows()) {
            specula_tensor::topk_row(row, k, ids, vals);
        }
    }

    fn block_conv(
        &self,
        x: &CpuTensor,
        dynamic: &CpuTensor,
        base: &CpuTensor,
        side: usize,
        kernel: usize,
        group: usize,
        out: &mut CpuTensor,
    ) {
        let (rows, e) = (x.rows(), x.cols());
        let mut o = Vec::new();
        specula_tensor::block_conv_rows(
            x.as_slice(),
            dynamic.as_slice(),
            base.as_slice(),
            side,
            (e, kernel, group),
            &mut o,
        );
        *out = CpuTensor::new(rows, e, o);
    }

    fn resize(&self, t: &mut CpuTensor, rows: usize, cols: usize) {
        t.resize(rows, cols);
    }

    fn copy_rows(&self, src: &CpuTensor, rows: &CpuIndex, out: &mut CpuTensor) {
        ops::copy_rows(src, rows.as_usize(), out);
    }

    fn put_rows(&self, src: &CpuTensor, rows: &CpuIndex, dst: &mut CpuTensor) {
        ops::put_rows(src, rows.as_usize(), dst);
    }

    fn get_rows(&self, table: &CpuWeight, ids: &CpuIndex, out: &mut CpuTensor) {
        ops::get_rows(self, table, ids.as_u32(), out);
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight, out: &mut CpuTensor) {
        matmul::matmul(self, x, w, out);
    }

    fn add_vector(&self, x: &mut CpuTensor, b: &CpuWeight) {
        ops::add_vector(self, x, b);
    }

    fn rms_norm(&self, x: &CpuTensor, w: Option<&CpuWeight>, eps: f32, out: &mut CpuTensor) {
        ops::rms_norm(self, x, w, eps, out);
    }

    fn rms_norm_groups(&self, x: &mut CpuTensor, group: usize, w: &CpuWeight, eps: f32) {
        ops::rms_norm_groups(self, x, group, w, eps);
    }

    fn rope(&self, x: &mut CpuTensor, head_dim: usize, pos: &CpuIndex, cfg: &RopeConfig) {
        rope::rope(self, x, head_dim, pos.as_u32(), cfg);
    }

    fn swiglu(&self, gate: &CpuTensor, up: &CpuTensor, out: &mut CpuTensor) {
        ops::swiglu(self, gate, up, out);
    }

    fn geglu(&self, gate: &CpuTensor, up: &CpuTensor, out: &mut CpuTensor) {
        ops::geglu(self, gate, up, out);
    }

    fn add(&self, a: &mut CpuTensor, b: &CpuTensor) {
        ops::add(self, a, b);
    }

    fn scale(&self, a: &mut CpuTensor, s: f32) {
        ops::scale(self, a, s);
    }

    fn routes(&self) -> CpuRoutes {
        CpuRoutes::default()
    }

    fn moe_route(
        &self,
        logits: &CpuTensor,
        p: &specula_tensor::MoeRoute,
        bias: Option<&CpuWeight>,
        out: &mut CpuRoutes,
    ) {
        moe::route(logits, p, bias, out);
    }

    fn routes_to_host(&self, r: &CpuRoutes, ids: &mut Vec<u32>, w: &mut Vec<f32>) {
        ids.clear();
        ids.extend_from_slice(r.ids());
        w.clear();
        w.extend_from_slice(r.weights());
    }

    fn matmul_id(
        &self,
        x: &CpuTensor,
        experts: &[CpuWeight],
        scales: Option<&[f32]>,
        r: &CpuRoutes,
        per_pair: bool,
        out: &mut CpuTensor,
    ) {
        moe::matmul_id(self, x, experts, scales, r, per_pair, out);
    }

    fn moe_ffn(
        &self,
        x: &CpuTensor,
        experts: &specula_tensor::MoeExperts<'_, CpuWeight>,
        r: &CpuRoutes,
        out: &mut CpuTensor,
    ) {
        moe::ffn(self, x, experts, r, out);
    }

    fn moe_combine(&self, y: &CpuTensor, r: &CpuRoutes, out: &mut CpuTensor) {
        moe::combine(y, r, out);
    }

    fn put_cols(&self, src: &CpuTensor, col0: usize, dst: &mut CpuTensor) {
        ops::put_cols(src, col0, dst);
    }

    fn clamp_finite(&self, x: &mut CpuTensor, limit: f32) {
        ops::clamp_finite(self, x, limit);
    }

    fn softcap(&self, x: &mut CpuTensor, c: f32) {
        ops::softcap(self, x, c);
    }

    fn silu(&self, x: &mut CpuTensor) {
        ops::silu_rows(self, x);
    }

    fn gate_mul(&self, x: &mut CpuTensor, gate: &CpuTensor, act: specula_tensor::GateAct) {
        ops::gate_mul(self, x, gate, act);
    }

    fn gather_cols(
        &self,
        src: &CpuTensor,
        stride: usize,
        range: std::ops::Range<usize>,
        out: &mut CpuTensor,
    ) {
        ops::gather_cols(src, stride, range, out);
    }

    fn ssm_conv(
        &self,
        kv: &mut CpuKv,
        layer: usize,
        pos0: usize,
        x: &CpuTensor,
        w: &CpuWeight,
        out: &mut CpuTensor,
    ) {
        recurrent::ssm_conv(kv.recurrent_mut(layer, "ssm_conv"), pos0, x, w, out);
    }

    fn gated_delta_net(
        &self,
        kv: &mut CpuKv,
        p: &specula_tensor::DeltaNetParams,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        alpha: &CpuTensor,
        beta: &CpuTensor,
        dt_bias: &CpuWeight,
        a: &CpuWeight,
        out: &mut CpuTensor,
    ) {
        let mem = kv.recurrent_mut(p.layer, "gated_delta_net");
        let gates = recurrent::Gates {
            alpha,
            beta,
            dt_bias: dt_bias.vector(alpha.cols(), "gated_delta_net"),
            a: a.vector(alpha.cols(), "gated_delta_net"),
        };
        recurrent::gated_delta_net(mem, p, q, k, v, &gates, out);
    }

    fn kv_holds(&self, kv: &CpuKv, pos: usize) -> bool {
        kv.recurrent_holds(pos)
    }

    fn kv_new(&self, shape: KvShape) -> Result<CpuKv> {
        CpuKv::new(shape)
    }

    fn kv_write(
        &self,
        kv: &mut CpuKv,
        layer: usize,
        cells: &CpuIndex,
        k: &CpuTensor,
        v: &CpuTensor,
    ) {
        attention::kv_write(self, kv, layer, cells.as_usize(), k, v);
    }

    fn kv_export(&self, kv: &CpuKv, n: usize, out: &mut Vec<u8>) -> Result<()> {
        kv.export_prefix(n, out).map_err(Into::into)
    }

    fn kv_import(&self, kv: &mut CpuKv, n: usize, bytes: &[u8]) -> Result<()> {
        kv.import_prefix(n, bytes).map_err(Into::into)
    }

    fn attention(
        &self,
        q: &CpuTensor,
        kv: &CpuKv,
        params: &AttentionParams<'_, CpuIndex>,
        out: &mut CpuTensor,
    ) {
        let host = params.with_positions(params.q_pos.as_u32(), params.kv_pos.as_u32());
        attention::attention(self, q, kv, &host, out);
    }

    fn attention_seqs(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        seqs: &mut [SeqAttention<'_, CpuKv, CpuIndex>],
        out: &mut CpuTensor,
    ) {
        attention::attention_seqs(self, q, k, v, seqs, out);
    }
}
