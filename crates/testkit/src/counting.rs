//! A backend that counts what crosses between host and device: every op goes to the backend
//! it wraps, and each transfer is tallied — floats downloaded by `to_host` (logits rows,
//! hidden-state taps), ids downloaded by `argmax_rows` and `top1_rows` (with one probability
//! per row), a mixture's routing downloaded by `routes_to_host` (a download of its ids and
//! weights), floats uploaded by `from_host` (and a mixture's expert scales by `matmul_id`),
//! index tensors uploaded by `index` and `set_index`. Tests run a generation on it and read the tallies, to show what a round moves
//! (issue 16's counting test backend).

use std::sync::atomic::{AtomicU64, Ordering};

use specula_tensor::{
    AttentionParams, Backend, DeltaNetParams, GateAct, KvShape, MoeExperts, MoeRoute, Result,
    RopeConfig, SeqAttention, WeightDesc,
};

/// What crossed so far ([`Counting::tally`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// `to_host` calls.
    pub downloads: u64,
    /// f32 values they downloaded.
    pub floats_down: u64,
    /// `argmax_rows`, `top1_rows` and `topk_rows` calls.
    pub argmax_calls: u64,
    /// Ids they downloaded (one per row; `k` per row for `topk_rows`).
    pub ids_down: u64,
    /// Probabilities `top1_rows` downloaded (one per row), and values `topk_rows` downloaded.
    pub probs_down: u64,
    /// f32 values `from_host` and `matmul_id` (a mixture's expert scales) uploaded.
    pub floats_up: u64,
    /// `index` and `set_index` calls with at least one index: index tensors built from the
    /// host.
    pub index_uploads: u64,
    /// Indices they uploaded.
    pub indices_up: u64,
}

/// `B` with its transfers counted.
#[derive(Debug, Default)]
pub struct Counting<B> {
    inner: B,
    downloads: AtomicU64,
    floats_down: AtomicU64,
    argmax_calls: AtomicU64,
    ids_down: AtomicU64,
    probs_down: AtomicU64,
    floats_up: AtomicU64,
    index_uploads: AtomicU64,
    indices_up: AtomicU64,
}

impl<B> Counting<B> {
    /// Wraps `inner`, every tally at zero.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            downloads: AtomicU64::new(0),
            floats_down: AtomicU64::new(0),
            argmax_calls: AtomicU64::new(0),
            ids_down: AtomicU64::new(0),
            probs_down: AtomicU64::new(0),
            floats_up: AtomicU64::new(0),
            index_uploads: AtomicU64::new(0),
            indices_up: AtomicU64::new(0),
        }
    }

    /// The tallies so far.
    pub fn tally(&self) -> Tally {
        Tally {
            downloads: self.downloads.load(Ordering::Relaxed),
            floats_down: self.floats_down.load(Ordering::Relaxed),
            argmax_calls: self.argmax_calls.load(Ordering::Relaxed),
            ids_down: self.ids_down.load(Ordering::Relaxed),
            probs_down: self.probs_down.load(Ordering::Relaxed),
            floats_up: self.floats_up.load(Ordering::Relaxed),
            index_uploads: self.index_uploads.load(Ordering::Relaxed),
            indices_up: self.indices_up.load(Ordering::Relaxed),
        }
    }
}

impl<B> Counting<B> {
    /// An index tensor built from `v` (an empty one moves nothing and is not counted).
    fn count_index(&self, v: &[u32]) {
        if !v.is_empty() {
            add(&self.index_uploads, 1);
            add(&self.indices_up, v.len());
        }
    }
}

fn add(c: &AtomicU64, n: usize) {
    c.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
}

impl<B: Backend> Backend for Counting<B> {
    type Tensor = B::Tensor;
    type Weight = B::Weight;
    type Kv = B::Kv;
    type Index = B::Index;
    type Routes = B::Routes;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn weight(&self, desc: WeightDesc<'_>) -> Result<Self::Weight> {
        self.inner.weight(desc)
    }
    fn prepare_matmul(&self, w: &mut Self::Weight) {
        self.inner.prepare_matmul(w);
    }
    fn zeros(&self, rows: usize, cols: usize) -> Self::Tensor {
        self.inner.zeros(rows, cols)
    }
    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Tensor {
        add(&self.floats_up, data.len());
        self.inner.from_host(rows, cols, data)
    }
    fn to_host(&self, t: &Self::Tensor, out: &mut Vec<f32>) {
        self.inner.to_host(t, out);
        add(&self.downloads, 1);
        add(&self.floats_down, out.len());
    }
    fn argmax_rows(&self, x: &Self::Tensor, out: &mut Vec<u32>) {
        self.inner.argmax_rows(x, out);
        add(&self.argmax_calls, 1);
        add(&self.ids_down, out.len());
    }
    fn top1_rows(&self, x: &Self::Tensor, ids: &mut Vec<u32>, probs: &mut Vec<f32>) {
        self.inner.top1_rows(x, ids, probs);
        add(&self.argmax_calls, 1);
        add(&self.ids_down, ids.len());
        add(&self.probs_down, probs.len());
    }
    fn topk_rows(&self, x: &Self::Tensor, k: usize, ids: &mut Vec<u32>, vals: &mut Vec<f32>) {
        self.inner.topk_rows(x, k, ids, vals);
        add(&self.argmax_calls, 1);
        add(&self.ids_down, ids.len());
        add(&self.probs_down, vals.len());
    }
    fn block_conv(
        &self,
        x: &Self::Tensor,
        dynamic: &Self::Tensor,
        base: &Self::Tensor,
        side: usize,
        kernel: usize,
        group: usize,
        out: &mut Self::Tensor,
    ) {
        self.inner
            .block_conv(x, dynamic, base, side, kernel, group, out);
    }
    fn shape(&self, t: &Self::Tensor) -> (usize, usize) {
        self.inner.shape(t)
    }
    fn index(&self, v: &[u32]) -> Self::Index {
        self.count_index(v);
        self.inner.index(v)
    }
    fn set_index(&self, i: &mut Self::Index, v: &[u32]) {
        self.count_index(v);
        self.inner.set_index(i, v);
    }
    fn index_len(&self, i: &Self::Index) -> usize {
        self.inner.index_len(i)
    }
    fn resize(&self, t: &mut Self::Tensor, rows: usize, cols: usize) {
        self.inner.resize(t, rows, cols);
    }
    fn copy_rows(&self, src: &Self::Tensor, rows: &Self::Index, out: &mut Self::Tensor) {
        self.inner.copy_rows(src, rows, out);
    }
    fn put_rows(&self, src: &Self::Tensor, rows: &Self::Index, dst: &mut Self::Tensor) {
        self.inner.put_rows(src, rows, dst);
    }
    fn get_rows(&self, table: &Self::Weight, ids: &Self::Index, out: &mut Self::Tensor) {
        self.inner.get_rows(table, ids, out);
    }
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor) {
        self.inner.matmul(x, w, out);
    }
    fn add_vector(&self, x: &mut Self::Tensor, b: &Self::Weight) {
        self.inner.add_vector(x, b);
    }
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: Option<&Self::Weight>,
        eps: f32,
        out: &mut Self::Tensor,
    ) {
        self.inner.rms_norm(x, w, eps, out);
    }
    fn rms_norm_groups(&self, x: &mut Self::Tensor, group: usize, w: &Self::Weight, eps: f32) {
        self.inner.rms_norm_groups(x, group, w, eps);
    }
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, pos: &Self::Index, cfg: &RopeConfig) {
        self.inner.rope(x, head_dim, pos, cfg);
    }
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor) {
        self.inner.swiglu(gate, up, out);
    }
    fn geglu(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor) {
        self.inner.geglu(gate, up, out);
    }
    fn add(&self, a: &mut Self::Tensor, b: &Self::Tensor) {
        self.inner.add(a, b);
    }
    fn scale(&self, a: &mut Self::Tensor, s: f32) {
        self.inner.scale(a, s);
    }
    fn softcap(&self, x: &mut Self::Tensor, c: f32) {
        self.inner.softcap(x, c);
    }
    fn silu(&self, x: &mut Self::Tensor) {
        self.inner.silu(x);
    }
    fn gate_mul(&self, x: &mut Self::Tensor, gate: &Self::Tensor, act: GateAct) {
        self.inner.gate_mul(x, gate, act);
    }
    fn gather_cols(
        &self,
        src: &Self::Tensor,
        stride: usize,
        range: std::ops::Range<usize>,
        out: &mut Self::Tensor,
    ) {
        self.inner.gather_cols(src, stride, range, out);
    }
    fn put_cols(&self, src: &Self::Tensor, col0: usize, dst: &mut Self::Tensor) {
        self.inner.put_cols(src, col0, dst);
    }
    fn clamp_finite(&self, x: &mut Self::Tensor, limit: f32) {
        self.inner.clamp_finite(x, limit);
    }
    fn weight_views(
        &self,
        desc: &WeightDesc<'_>,
        rows: &[std::ops::Range<usize>],
    ) -> Result<Vec<Self::Weight>> {
        self.inner.weight_views(desc, rows)
    }
    fn routes(&self) -> Self::Routes {
        self.inner.routes()
    }
    fn moe_route(
        &self,
        logits: &Self::Tensor,
        p: &MoeRoute,
        bias: Option<&Self::Weight>,
        out: &mut Self::Routes,
    ) {
        self.inner.moe_route(logits, p, bias, out);
    }
    fn routes_to_host(&self, r: &Self::Routes, ids: &mut Vec<u32>, w: &mut Vec<f32>) {
        self.inner.routes_to_host(r, ids, w);
        add(&self.downloads, 1);
        add(&self.ids_down, ids.len());
        add(&self.floats_down, w.len());
    }
    fn matmul_id(
        &self,
        x: &Self::Tensor,
        experts: &[Self::Weight],
        scales: Option<&[f32]>,
        r: &Self::Routes,
        per_pair: bool,
        out: &mut Self::Tensor,
    ) {
        add(&self.floats_up, scales.map_or(0, <[f32]>::len));
        self.inner.matmul_id(x, experts, scales, r, per_pair, out);
    }
    fn moe_ffn(
        &self,
        x: &Self::Tensor,
        experts: &MoeExperts<'_, Self::Weight>,
        r: &Self::Routes,
        out: &mut Self::Tensor,
    ) {
        let scales = [experts.gate_scales, experts.up_scales, experts.down_scales];
        add(
            &self.floats_up,
            scales.iter().flatten().map(|s| s.len()).sum(),
        );
        self.inner.moe_ffn(x, experts, r, out);
    }
    fn moe_combine(&self, y: &Self::Tensor, r: &Self::Routes, out: &mut Self::Tensor) {
        self.inner.moe_combine(y, r, out);
    }
    fn kv_new(&self, shape: KvShape) -> Result<Self::Kv> {
        self.inner.kv_new(shape)
    }
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        cells: &Self::Index,
        k: &Self::Tensor,
        v: &Self::Tensor,
    ) {
        self.inner.kv_write(kv, layer, cells, k, v);
    }
    fn kv_export(&self, kv: &Self::Kv, n: usize, out: &mut Vec<u8>) -> Result<()> {
        self.inner.kv_export(kv, n, out)
    }
    fn kv_import(&self, kv: &mut Self::Kv, n: usize, bytes: &[u8]) -> Result<()> {
        self.inner.kv_import(kv, n, bytes)
    }
    fn ssm_conv(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        pos0: usize,
        x: &Self::Tensor,
        w: &Self::Weight,
        out: &mut Self::Tensor,
    ) {
        self.inner.ssm_conv(kv, layer, pos0, x, w, out);
    }
    fn gated_delta_net(
        &self,
        kv: &mut Self::Kv,
        p: &DeltaNetParams,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        alpha: &Self::Tensor,
        beta: &Self::Tensor,
        dt_bias: &Self::Weight,
        a: &Self::Weight,
        out: &mut Self::Tensor,
    ) {
        self.inner
            .gated_delta_net(kv, p, q, k, v, alpha, beta, dt_bias, a, out);
    }
    fn kv_holds(&self, kv: &Self::Kv, pos: usize) -> bool {
        self.inner.kv_holds(kv, pos)
    }
    fn attention(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        params: &AttentionParams<'_, Self::Index>,
        out: &mut Self::Tensor,
    ) {
        self.inner.attention(q, kv, params, out);
    }
    fn attention_seqs(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        seqs: &mut [SeqAttention<'_, Self::Kv, Self::Index>],
        out: &mut Self::Tensor,
    ) {
        self.inner.attention_seqs(q, k, v, seqs, out);
    }
}
