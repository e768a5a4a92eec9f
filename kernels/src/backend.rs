//! [`CubeBackend`]: the `Backend` op set over a CubeCL client.

use std::sync::Mutex;

use cubecl::prelude::*;
use cubecl::server::Handle;
use specula_quant::QType;
use specula_tensor::{
    AttentionParams, Backend, DeltaNetParams, GateAct, KvShape, Mask, MoeRoute, RecurrentShape,
    Result, RopeConfig, RopeKind, SeqAttention, StateSource, StateTimeline, TensorError,
    WeightDesc,
};

use crate::kernels::{
    attention as at, elementwise as ew, kv as kq, matmul as mm, moe, recurrent as rec,
};
use crate::layout::{self, ActQuant, GroupFormat};

/// Groups of a row whose integer sums a matmul cube keeps at once (the segment, in blocks,
/// is this over the groups per block).
const SEG_GROUPS: usize = 128;

/// Attention's chunk states are cut into launches of at most this many f32 values.
const MAX_SCORES: usize = 1 << 26;

/// The most (row, expert) pairs [`Backend::matmul_id`] runs as one routed launch, reading the
/// routing on the device (a decode step's few tokens). Past it (a prefill) one launch per
/// pair would read each expert's weights once per pair; grouping the pairs by expert on the
/// host, one tiled matmul per expert, reads them once per tile of rows.
const ROUTED_PAIRS: usize = 64;

/// The CubeCL backend on one device.
pub struct CubeBackend {
    client: Client,
    name: &'static str,
    /// Units per cube of the reducing kernels (a power of two).
    units: usize,
    /// Units per cube of the element-wise kernels.
    ew: u32,
    /// The RoPE angle tables of the latest position indices (index id, config, device table):
    /// every layer of a forward rotates its Q and K rows by the same position index, so each
    /// config's table is made once per forward ([`ROPE_TABLES`] configs kept: Gemma's local
    /// and global layers alternate two).
    rope: Mutex<Vec<(u64, RopeConfig, Handle)>>,
    /// The identity index `0..n` of the largest `n` asked so far (column gathers read it).
    iota: Mutex<(usize, Handle)>,
    /// The id of the next index tensor.
    next_index: std::sync::atomic::AtomicU64,
    /// The id of the next upload shared by weight views ([`Backend::weight_views`]).
    next_stack: std::sync::atomic::AtomicU64,
    /// One zero word: the operand a kernel is passed where its variant reads none (a plain
    /// matmul's expert ids and scales).
    unused: Handle,
    /// The table of the softmax's `e^x` ([`specula_cpu::expf::TAB`]).
    exp_tab: Handle,
    /// The codebooks of the codebook weight formats ([`layout::Table::all`]).
    nl_tab: Handle,
    /// The turbo caches' rotation signs, centroids and thresholds (`kv::turbo_tables`).
    turbo_tab: Handle,
}

/// RoPE angle tables kept by [`CubeBackend`].
const ROPE_TABLES: usize = 4;

/// The CubeCL backend's index tensor: the indices on the device, and their host copy (the
/// host-side bounds checks and the RoPE angle table read it, so no index is read back), with
/// an id that names its contents for the RoPE table cache.
pub struct CubeIndex {
    h: Handle,
    host: Vec<u32>,
    /// The largest index (`None` when empty).
    max: Option<u32>,
    id: u64,
}

impl std::fmt::Debug for CubeIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeIndex")
            .field("len", &self.host.len())
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl CubeIndex {
    /// Whether every index is below `n`.
    fn below(&self, n: usize) -> bool {
        self.max.is_none_or(|m| (m as usize) < n)
    }
}

/// An f32 activation matrix on the device.
#[derive(Debug)]
pub struct CubeTensor {
    h: Handle,
    rows: usize,
    cols: usize,
    /// Values the allocation holds.
    cap: usize,
}

/// A weight on the device: f32 values, or the group layout of an integer block format; or a
/// view of rows `row0..row0 + n_out` of such an upload, sharing its buffers with the other
/// views of it ([`Backend::weight_views`]: a mixture's experts).
#[derive(Debug)]
pub struct CubeWeight {
    name: String,
    ty: QType,
    n_in: usize,
    n_out: usize,
    /// The first row of the buffers this weight is (0 but for a view).
    row0: usize,
    /// The upload this weight is a view of (`None`: a weight of its own), which tells
    /// [`Backend::matmul_id`] that a list of experts lies in one set of buffers.
    stack: Option<u64>,
    data: WeightData,
}

impl CubeWeight {
    /// The f32 values of a weight whose values start its buffer: vectors and convolution
    /// taps, which their kernels read from the start (not a view past the first row).
    fn floats(&self) -> Option<&Handle> {
        match &self.data {
            WeightData::F32(h) if self.row0 == 0 => Some(h),
            _ => None,
        }
    }
}

/// The CubeCL backend's routing of a batch ([`Backend::moe_route`]): the expert and the
/// weight of every (row, slot) pair on the device, row after row, each row's by increasing
/// expert; the sizes on the host, so that reading them never waits for the device.
#[derive(Debug)]
pub struct CubeRoutes {
    /// `n · n_used` expert ids (u32).
    ids: Handle,
    /// `n · n_used` weights (f32).
    w: Handle,
    /// Rows.
    n: usize,
    /// Experts per row.
    n_used: usize,
    /// Experts routed over (every id is below it).
    n_expert: usize,
    /// Pairs the buffers hold.
    cap: usize,
}

/// A routed matmul's operands ([`CubeBackend::launch_matmul`]): output row `p` is activation
/// row `p / div` times the view of expert `ids[p]` at `row0 + ids[p] · stride`, times
/// `scales[ids[p]]` where given.
struct Routed {
    ids: Handle,
    scales: Option<Handle>,
    stride: usize,
    div: usize,
}

#[derive(Clone, Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per weight matrix: five handles beside one are not worth a box"
)]
enum WeightData {
    F32(Handle),
    Groups {
        fmt: GroupFormat,
        codes: Handle,
        /// `d` per block.
        bd: Handle,
        /// `m` / `dmin` per block.
        bm: Handle,
        /// Integer scale per group (K-quants).
        gsc: Handle,
        /// Integer min per group (Q4_K, Q5_K).
        gmn: Handle,
    },
}

/// One layer's K and V cells.
#[derive(Debug)]
struct LayerKv {
    k: Plane,
    v: Plane,
    /// The element type of the float planes: f16 (else f32).
    f16: bool,
    cells: usize,
    n_kv_head: usize,
    hd_k: usize,
    hd_v: usize,
}

/// The K or V cells of a layer on the device.
#[derive(Debug)]
enum Plane {
    /// f16 or f32 values (`LayerKv::f16`), `cells · n_kv_head · head_dim`.
    Float(Handle),
    /// A 32-value block format in the device layout (`kernels::kv`): each head less its
    /// offset, rotated, quantized — the CPU backend's cache (`specula_kv::Plane`).
    Blocks(Box<BlockPlane>),
    /// turbo2/3/4 of heads of whole 128-value groups: each head less its offset, per group
    /// the codes (`bits` each) and the stored norm (f16 as f32), in the rotated domain.
    Turbo(Box<TurboPlane>),
}

/// A turbo plane: codes, norms and the per-head offset.
#[derive(Debug)]
struct TurboPlane {
    bits: u32,
    /// Values stored per head: the head, or 128 for a 64-value head in two stages.
    dim: usize,
    codes: Handle,
    norms: Handle,
    /// `n_kv_head · head_dim` offsets: the mean of the first rows written.
    center: Handle,
    calibrated: bool,
    /// A 64-value head's two-stage encoder and reader (`specula_kv::turbo_two_stage`).
    two: Option<TwoStage>,
}

/// Values per head of a turbo plane as attention reads them: the stored width, or a
/// two-stage head's 64 (`y_i + β·y_{64+i}`, `kernels::kv::turbo_two_value`).
fn read_width(t: &TurboPlane) -> usize {
    if t.two.is_some() { 64 } else { t.dim }
}

/// The tables of two-stage turbo heads on the device (`specula_kv::two_stage_tables`).
#[derive(Debug)]
struct TwoStage {
    /// The levels, the midpoints, `lo`, `inv_width`, `last_bin`, then the starting scales.
    lf: Handle,
    /// The levels' code pairs (`a | b << 8`), then the bins' first midpoints.
    lu: Handle,
    /// Levels.
    nl: usize,
    /// The fine half's weight `β`.
    beta: f32,
    /// Lloyd steps of the norm's fit.
    steps: u32,
}

impl TwoStage {
    fn new(be: &CubeBackend, ty: QType) -> Option<Self> {
        let beta = specula_kv::turbo_two_stage(ty, 64, 128)?;
        let t = specula_kv::two_stage_tables(ty)?;
        let nl = t.value.len();
        let mut lf = t.value.clone();
        lf.extend_from_slice(&t.mid);
        lf.extend_from_slice(&[t.lo, t.inv_width, t.last_bin, beta]);
        lf.extend_from_slice(&t.starts);
        let mut lu: Vec<u32> = t
            .pair
            .iter()
            .map(|&(a, b)| u32::from(a) | (u32::from(b) << 8))
            .collect();
        lu.extend(t.below.iter().map(|&b| u32::from(b)));
        Some(Self {
            lf: be.upload_f32(&lf),
            lu: be.upload_u32(&lu),
            nl,
            beta,
            steps: u32::try_from(t.steps).ok()?,
        })
    }
}

/// The kernels' term code of a turbo plane (`kernels::attention::attn_chunk`).
const TURBO_TERM: u32 = 5;

/// The first bytes of this backend's cache export ([`Backend::kv_export`]): another backend's
/// export (or a damaged file) is refused rather than read as cells.
const KV_TAG: &[u8; 8] = b"cubekv01";

/// A block-format plane: codes, scales and the per-head offset.
#[derive(Debug)]
struct BlockPlane {
    fmt: GroupFormat,
    codes: Handle,
    d: Handle,
    m: Handle,
    /// `n_kv_head · head_dim` offsets: the mean of the first rows written.
    center: Handle,
    calibrated: bool,
    /// Values per Hadamard group (0: not rotated) and `1/√had`.
    had: usize,
    hscale: f32,
}

impl BlockPlane {
    /// The kernels' compile-time format: bits, offset, term code.
    fn code(&self) -> (u32, u32, u32) {
        (self.fmt.bits, self.fmt.offset, self.fmt.term.code())
    }
}

impl Plane {
    fn blocks(&self) -> Option<&BlockPlane> {
        match self {
            Self::Blocks(b) => Some(b),
            _ => None,
        }
    }

    /// The kernels' compile-time format: bits, offset, term code (`(0, 0, 0)`: floats).
    fn code(&self) -> (u32, u32, u32) {
        match self {
            Self::Float(_) => (0, 0, 0),
            Self::Blocks(b) => b.code(),
            Self::Turbo(t) => (t.bits, 0, TURBO_TERM),
        }
    }

    /// The buffers holding the first `cells` cells of this plane (heads of `hd` values, `n_kv`
    /// per cell, floats of `esz` bytes), with the bytes of each that hold them: a prefix of
    /// each, since every layout is cell-major; a quantized plane adds its offsets.
    fn prefix(&self, cells: usize, n_kv: usize, hd: usize, esz: usize) -> Vec<(&Handle, usize)> {
        let values = cells * n_kv * hd;
        match self {
            Self::Float(h) => vec![(h, values * esz)],
            Self::Blocks(b) => {
                let nb = values / 32;
                let mut v = vec![(&b.codes, nb * b.fmt.words() * 4), (&b.d, nb * 4)];
                if b.fmt.block_min() {
                    v.push((&b.m, nb * 4));
                }
                v.push((&b.center, n_kv * hd * 4));
                v
            }
            Self::Turbo(t) => {
                let ng = cells * n_kv * t.dim / 128;
                vec![
                    (&t.codes, ng * 4 * t.bits as usize * 4),
                    (&t.norms, ng * 4),
                    (&t.center, n_kv * hd * 4),
                ]
            }
        }
    }

    /// Whether a quantized plane has its offsets (`None` for floats).
    fn calibrated_mut(&mut self) -> Option<&mut bool> {
        match self {
            Self::Float(_) => None,
            Self::Blocks(b) => Some(&mut b.calibrated),
            Self::Turbo(t) => Some(&mut t.calibrated),
        }
    }

    /// The per-head offsets of a quantized plane.
    fn center(&self) -> Option<&Handle> {
        match self {
            Self::Float(_) => None,
            Self::Blocks(b) => Some(&b.center),
            Self::Turbo(t) => Some(&t.center),
        }
    }
}

/// The cache formats the device keeps: f16 and f32 (the same for K and V), the 32-value
/// block formats and turbo2/3/4 (heads of whole 128-value groups), each of K and V chosen
/// apart.
const CACHE_FORMATS: &str = "f16, f32, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, and turbo2/3/4 for heads of a multiple of 128 values";

/// `1/√n` as the CPU backend's Hadamard transform computes it.
#[allow(clippy::cast_precision_loss, reason = "n is a small power of two")]
fn hadamard_scale(n: usize) -> f32 {
    if n == 0 { 1.0 } else { 1.0 / (n as f32).sqrt() }
}

/// The KV cache of all layers, on the device.
#[derive(Debug)]
pub struct CubeKv {
    n_ctx: usize,
    layers: Vec<LayerKv>,
    /// Per layer, the states of a recurrent (gated delta-net) layer.
    recurrent: Vec<Option<RecurrentKv>>,
}

/// The two states of a recurrent layer on the device.
#[derive(Debug)]
struct RecurrentKv {
    shape: RecurrentShape,
    conv: Timeline,
    ssm: Timeline,
}

/// One recurrent state over time on the device: the current state, the one before the latest
/// forward and the snapshot slots the kernels fill, their positions in a [`StateTimeline`]
/// (the CPU backend's bookkeeping).
#[derive(Debug)]
struct Timeline {
    cur: Handle,
    before: Handle,
    /// `keep` states, slot after slot.
    snaps: Handle,
    pos: StateTimeline,
    len: usize,
}

impl Timeline {
    fn new(be: &CubeBackend, len: usize, keep: usize) -> Self {
        let zeros = vec![0f32; len];
        Self {
            cur: be.upload_f32(&zeros),
            before: be.upload_f32(&zeros),
            snaps: be.empty_f32(keep * len),
            pos: StateTimeline::new(keep),
            len,
        }
    }

    /// Makes `cur` the state at `pos` and starts a forward of `rows` rows there.
    fn begin(&mut self, be: &CubeBackend, pos: usize, rows: usize, what: &str) {
        match self.pos.source(pos) {
            Some(StateSource::Current) => {}
            Some(StateSource::Zero) => self.cur = be.upload_f32(&vec![0f32; self.len]),
            Some(StateSource::Before) => be.copy(&self.before, 0, &self.cur, 0, self.len),
            Some(StateSource::Snapshot(s)) => {
                be.copy(&self.snaps, s * self.len, &self.cur, 0, self.len);
            }
            None => panic!("{}", self.pos.not_kept(what, pos)),
        }
        be.copy(&self.cur, 0, &self.before, 0, self.len);
        self.pos.begin(pos, rows);
    }

    /// Records a forward of `rows` rows done (the kernel wrote the snapshots).
    fn end(&mut self, rows: usize) {
        for i in 0..rows {
            self.pos.after_row(i, rows);
        }
    }

    fn keep(&self) -> usize {
        self.pos.keep()
    }
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    f32::as_bytes(v)
}

fn u32_bytes(v: &[u32]) -> &[u8] {
    u32::as_bytes(v)
}

/// `n` as a kernel's u32 size argument.
fn u(n: usize) -> u32 {
    u32::try_from(n).expect("device sizes fit in u32")
}

/// The row stride of experts that are views of one upload at evenly spaced rows (view `e`
/// at `row0 + e · stride`: a stack of experts, or one half of each expert of a fused
/// gate-and-up stack), which one routed launch reads by id; `None` for any other list.
fn one_stack(experts: &[CubeWeight]) -> Option<usize> {
    let first = experts.first()?;
    let stack = first.stack?;
    let stride = match experts.get(1) {
        Some(w) => w.row0.checked_sub(first.row0)?,
        None => 0,
    };
    experts
        .iter()
        .enumerate()
        .all(|(e, w)| w.stack == Some(stack) && w.row0 == first.row0 + e * stride)
        .then_some(stride)
}

impl std::fmt::Debug for CubeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeBackend")
            .field("name", &self.name)
            .field("units", &self.units)
            .field("ew", &self.ew)
            .finish_non_exhaustive()
    }
}

impl CubeBackend {
    /// A backend on `client`; `name` is what [`Backend::name`] reports (`cuda`, `cubecl-cpu`).
    #[must_use]
    pub fn new(client: Client, name: &'static str) -> Self {
        let hw = &client.properties().hardware;
        let (units, ew) = if hw.plane_size_max <= 1 {
            // CubeCL's CPU runtime: one thread per unit of a cube.
            let cores = hw.num_cpu_cores.unwrap_or(1).max(1) as usize;
            let p = 1usize << cores.ilog2();
            (p, u(p))
        } else {
            (128, 256)
        };
        let exp_tab = client.create_from_slice(u64::as_bytes(&specula_cpu::expf::TAB));
        let nl_tab = client.create_from_slice(i32::as_bytes(&layout::Table::all()));
        let turbo_tab = client.create_from_slice(f32::as_bytes(&kq::turbo_tables()));
        let iota = client.empty(4);
        let unused = client.create_from_slice(u32::as_bytes(&[0]));
        Self {
            client,
            name,
            units,
            ew,
            rope: Mutex::new(Vec::new()),
            iota: Mutex::new((0, iota)),
            next_index: std::sync::atomic::AtomicU64::new(0),
            next_stack: std::sync::atomic::AtomicU64::new(0),
            unused,
            exp_tab,
            nl_tab,
            turbo_tab,
        }
    }

    /// The backend on CubeCL's CPU runtime (the CI target of the kernels).
    ///
    /// # Errors
    /// When the CPU runtime is not compiled in (feature `cpu`).
    pub fn cpu() -> Result<Self> {
        let dev = cubecl::Device::cpu().map_err(|e| TensorError::Unsupported {
            backend: "cubecl-cpu",
            what: format!("this build ({e})"),
        })?;
        Ok(Self::new(dev.client(), "cubecl-cpu"))
    }

    /// The backend on CUDA device `index`.
    ///
    /// # Errors
    /// When CUDA is not compiled in (feature `cuda`), or the machine has no such device (no
    /// driver, no GPU): checked before any CUDA call, so it never panics.
    pub fn cuda(index: usize) -> Result<Self> {
        let dev = cubecl::Device::cuda(index).map_err(|e| TensorError::Unsupported {
            backend: "cuda",
            what: format!("device cuda:{index}: {e}"),
        })?;
        Ok(Self::new(dev.client(), "cuda"))
    }

    /// The backend with `units` units per cube in its reducing kernels (a power of two; the
    /// default is 128 on a GPU, the core count on the CPU runtime): for benches that sweep it.
    ///
    /// # Panics
    /// If `units` is not a power of two.
    #[must_use]
    pub fn with_units(mut self, units: usize) -> Self {
        assert!(units.is_power_of_two(), "units per cube: a power of two");
        self.units = units;
        self
    }

    /// The CubeCL client (for benches that launch kernels themselves).
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Waits for every launched kernel (a timing point).
    pub fn sync(&self) {
        cubecl::future::block_on(self.client.sync()).expect("device sync");
    }

    fn empty_f32(&self, n: usize) -> Handle {
        self.client.empty(n.max(1) * 4)
    }

    fn upload_u32(&self, v: &[u32]) -> Handle {
        if v.is_empty() {
            return self.client.empty(4);
        }
        self.client.create_from_slice(u32_bytes(v))
    }

    fn upload_f32(&self, v: &[f32]) -> Handle {
        if v.is_empty() {
            return self.client.empty(4);
        }
        self.client.create_from_slice(f32_bytes(v))
    }

    fn ew_count(&self, n: usize) -> CubeCount {
        CubeCount::Static(u(n.div_ceil(self.ew as usize)).max(1), 1, 1)
    }

    /// `out = op(a, b)` element-wise over `n` values ([`ew::elementwise`]).
    #[allow(clippy::too_many_arguments, reason = "the op's operands")]
    fn elementwise(
        &self,
        op: u32,
        a: &Handle,
        b: &Handle,
        out: &Handle,
        n: usize,
        s: f32,
        per: usize,
    ) {
        if n == 0 {
            return;
        }
        // SAFETY: every handle holds at least the values the kernel indexes (`n`, or the
        // broadcast operand's `per`-based range), checked by the callers' shapes.
        unsafe {
            ew::elementwise::launch(
                &self.client,
                self.ew_count(n),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(a.clone(), n),
                BufferArg::from_raw_parts(b.clone(), n),
                BufferArg::from_raw_parts(out.clone(), n),
                u(n),
                s,
                u(per.max(1)),
                op,
            );
        }
    }

    /// The identity index `0..n` (at least), made once for the largest `n` asked.
    fn iota(&self, n: usize) -> Handle {
        let mut cache = self.iota.lock().expect("iota lock");
        if cache.0 < n {
            let v: Vec<u32> = (0..u(n.next_power_of_two())).collect();
            *cache = (v.len(), self.upload_u32(&v));
        }
        cache.1.clone()
    }

    /// Gathers `width` columns from each group of `stride` columns (starting at `start`) of
    /// source rows `idx` (`n_idx` of them, on the device) into `out` (`cols` wide).
    #[allow(clippy::too_many_arguments, reason = "a gather's shape")]
    fn gather(
        &self,
        src: &Handle,
        src_cols: usize,
        idx: &Handle,
        n_idx: usize,
        out: &Handle,
        cols: usize,
        width: usize,
        stride: usize,
        start: usize,
    ) {
        let n = n_idx * cols;
        if n == 0 {
            return;
        }
        // SAFETY: `idx` rows lie inside `src` and `out` holds `n_idx · cols` values.
        unsafe {
            ew::gather::launch(
                &self.client,
                self.ew_count(n),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(src.clone(), 1),
                BufferArg::from_raw_parts(idx.clone(), n_idx),
                BufferArg::from_raw_parts(out.clone(), n),
                u(n),
                u(cols),
                u(src_cols),
                u(width),
                u(stride),
                u(start),
            );
        }
    }

    fn check_same(op: &'static str, a: &CubeTensor, b: &CubeTensor) {
        assert_eq!(
            (a.rows, a.cols),
            (b.rows, b.cols),
            "{op}: operand shapes differ"
        );
    }

    fn rope_table(&self, pos: &CubeIndex, cfg: &RopeConfig) -> Handle {
        let mut cache = self.rope.lock().expect("rope cache lock");
        if let Some((_, _, h)) = cache.iter().find(|(id, c, _)| *id == pos.id && c == cfg) {
            return h.clone();
        }
        let t = specula_cpu::angle_table(cfg, &pos.host);
        let h = self.upload_f32(&t);
        if cache.first().is_some_and(|(id, _, _)| *id != pos.id) {
            // A new forward's positions: the tables of the last are done with.
            cache.clear();
        }
        if cache.len() == ROPE_TABLES {
            cache.remove(0);
        }
        cache.push((pos.id, cfg.clone(), h.clone()));
        h
    }
}

impl Backend for CubeBackend {
    type Tensor = CubeTensor;
    type Weight = CubeWeight;
    type Kv = CubeKv;
    type Index = CubeIndex;
    type Routes = CubeRoutes;

    fn name(&self) -> &'static str {
        self.name
    }

    fn weight(&self, desc: WeightDesc<'_>) -> Result<CubeWeight> {
        let n_in = desc.dims.first().copied().unwrap_or(1);
        let n_out: usize = desc.dims.iter().skip(1).product();
        let n = n_in * n_out;
        let expected = desc.ty.row_bytes(n_in).map(|b| b * n_out)?;
        if desc.data.len() != expected {
            return Err(TensorError::WeightSize {
                name: desc.name.to_owned(),
                ty: desc.ty,
                dims: desc.dims.to_vec(),
                expected,
                got: desc.data.len(),
            });
        }
        if u32::try_from(n).is_err() {
            return Err(TensorError::Unsupported {
                backend: self.name,
                what: format!(
                    "weight `{}` of {n} values (the kernels index with 32 bits: at most {})",
                    desc.name,
                    u32::MAX
                ),
            });
        }
        let data = match desc.ty {
            QType::F32 | QType::F16 | QType::BF16 => {
                let mut v = vec![0f32; n];
                specula_quant::dequantize_row(desc.ty, desc.data, &mut v)?;
                WeightData::F32(self.upload_f32(&v))
            }
            ty => {
                let Some(fmt) = GroupFormat::of(ty) else {
                    return Err(TensorError::UnsupportedWeight {
                        name: desc.name.to_owned(),
                        ty,
                        backend: self.name,
                        op: "weights (formats on the device: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, mxfp4, nvfp4)",
                    });
                };
                let g = layout::unpack(ty, desc.data);
                let ints = |v: &[i32]| {
                    if v.is_empty() {
                        self.client.empty(4)
                    } else {
                        self.client.create_from_slice(i32::as_bytes(v))
                    }
                };
                WeightData::Groups {
                    fmt,
                    codes: self.upload_u32(&g.codes),
                    bd: self.upload_f32(&g.d),
                    bm: self.upload_f32(&g.m),
                    gsc: ints(&g.sc),
                    gmn: ints(&g.mn),
                }
            }
        };
        Ok(CubeWeight {
            name: desc.name.to_owned(),
            ty: desc.ty,
            n_in,
            n_out,
            row0: 0,
            stack: None,
            data,
        })
    }

    fn weight_views(
        &self,
        desc: &WeightDesc<'_>,
        rows: &[std::ops::Range<usize>],
    ) -> Result<Vec<CubeWeight>> {
        let (n_in, _) = desc.view_rows(rows)?;
        // One upload of the whole matrix (its size checked there); every view shares its
        // buffers and reads its own rows of them.
        let whole = self.weight(desc.clone())?;
        let stack = self
            .next_stack
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(rows
            .iter()
            .map(|r| CubeWeight {
                name: format!("{} rows {r:?}", desc.name),
                ty: desc.ty,
                n_in,
                n_out: r.len(),
                row0: r.start,
                stack: Some(stack),
                data: whole.data.clone(),
            })
            .collect())
    }

    fn zeros(&self, rows: usize, cols: usize) -> CubeTensor {
        let n = rows * cols;
        CubeTensor {
            h: self.upload_f32(&vec![0f32; n.max(1)]),
            rows,
            cols,
            cap: n.max(1),
        }
    }

    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CubeTensor {
        assert_eq!(
            data.len(),
            rows * cols,
            "from_host: {rows}×{cols} needs {} values",
            rows * cols
        );
        CubeTensor {
            h: self.upload_f32(data),
            rows,
            cols,
            cap: data.len().max(1),
        }
    }

    fn to_host(&self, t: &CubeTensor, out: &mut Vec<f32>) {
        let n = t.rows * t.cols;
        out.clear();
        if n == 0 {
            return;
        }
        let bytes = self
            .client
            .read_one(t.h.clone())
            .unwrap_or_else(|e| panic!("{} backend: a kernel failed: {e:?}", self.name));
        out.extend_from_slice(&f32::from_bytes(&bytes)[..n]);
    }

    fn index(&self, v: &[u32]) -> CubeIndex {
        CubeIndex {
            h: self.upload_u32(v),
            host: v.to_vec(),
            max: v.iter().copied().max(),
            id: self
                .next_index
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    fn set_index(&self, i: &mut CubeIndex, v: &[u32]) {
        *i = self.index(v);
    }

    fn index_len(&self, i: &CubeIndex) -> usize {
        i.host.len()
    }

    fn shape(&self, t: &CubeTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn argmax_rows(&self, x: &CubeTensor, out: &mut Vec<u32>) {
        out.clear();
        if x.rows == 0 {
            return;
        }
        let ids = self.client.empty(x.rows * 4);
        // SAFETY: `x` holds `rows · cols` values, `ids` one u32 per row.
        unsafe {
            ew::argmax_rows::launch(
                &self.client,
                CubeCount::Static(u(x.rows), 1, 1),
                CubeDim::new_1d(u(self.units)),
                BufferArg::from_raw_parts(x.h.clone(), x.rows * x.cols),
                BufferArg::from_raw_parts(ids.clone(), x.rows),
                u(x.cols),
                self.units,
            );
        }
        let bytes = self
            .client
            .read_one(ids)
            .unwrap_or_else(|e| panic!("{} backend: a kernel failed: {e:?}", self.name));
        out.extend_from_slice(&u32::from_bytes(&bytes)[..x.rows]);
    }

    fn top1_rows(&self, x: &CubeTensor, ids: &mut Vec<u32>, probs: &mut Vec<f32>) {
        ids.clear();
        probs.clear();
        if x.rows == 0 {
            return;
        }
        let id_h = self.client.empty(x.rows * 4);
        let p_h = self.client.empty(x.rows * 4);
        // SAFETY: `x` holds `rows · cols` values, `id_h` and `p_h` one value per row.
        unsafe {
            ew::top1_rows::launch(
                &self.client,
                CubeCount::Static(u(x.rows), 1, 1),
                CubeDim::new_1d(u(self.units)),
                BufferArg::from_raw_parts(x.h.clone(), x.rows * x.cols),
                BufferArg::from_raw_parts(id_h.clone(), x.rows),
                BufferArg::from_raw_parts(p_h.clone(), x.rows),
                u(x.cols),
                self.units,
            );
        }
        let read = |h| {
            self.client
                .read_one(h)
                .unwrap_or_else(|e| panic!("{} backend: a kernel failed: {e:?}", self.name))
        };
        ids.extend_from_slice(&u32::from_bytes(&read(id_h))[..x.rows]);
        probs.extend_from_slice(&f32::from_bytes(&read(p_h))[..x.rows]);
    }

    fn topk_rows(&self, x: &CubeTensor, k: usize, ids: &mut Vec<u32>, vals: &mut Vec<f32>) {
        ids.clear();
        vals.clear();
        let k = k.min(x.cols);
        if x.rows == 0 || k == 0 {
            return;
        }
        let n = x.rows * k;
        let (id_h, v_h) = (self.client.empty(n * 4), self.empty_f32(n));
        // SAFETY: `x` holds `rows · cols` values; `id_h` and `v_h` `k` values per row.
        unsafe {
            ew::topk_rows::launch(
                &self.client,
                CubeCount::Static(u(x.rows), 1, 1),
                CubeDim::new_1d(u(self.units)),
                BufferArg::from_raw_parts(x.h.clone(), x.rows * x.cols),
                BufferArg::from_raw_parts(id_h.clone(), n),
                BufferArg::from_raw_parts(v_h.clone(), n),
                u(x.cols),
                u(k),
                self.units,
            );
        }
        let read = |h| {
            self.client
                .read_one(h)
                .unwrap_or_else(|e| panic!("{} backend: a kernel failed: {e:?}", self.name))
        };
        ids.extend_from_slice(&u32::from_bytes(&read(id_h))[..n]);
        vals.extend_from_slice(&f32::from_bytes(&read(v_h))[..n]);
    }

    fn block_conv(
        &self,
        x: &CubeTensor,
        dynamic: &CubeTensor,
        base: &CubeTensor,
        side: usize,
        kernel: usize,
        group: usize,
        out: &mut CubeTensor,
    ) {
        let (n, e) = (x.rows, x.cols);
        assert!(
            side < 2 && group > 0 && e.is_multiple_of(group),
            "block_conv: side {side}, groups of {group} in {e}"
        );
        assert_eq!(
            (dynamic.rows, dynamic.cols, base.rows, base.cols),
            (n, 2 * kernel * (e / group), 2 * kernel, e),
            "block_conv: operand shapes"
        );
        self.resize(out, n, e);
        let total = n * e;
        if total == 0 {
            return;
        }
        // SAFETY: the shapes are checked above; `out` holds `n · e` values.
        unsafe {
            ew::block_conv::launch(
                &self.client,
                self.ew_count(total),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(x.h.clone(), total),
                BufferArg::from_raw_parts(dynamic.h.clone(), dynamic.rows * dynamic.cols),
                BufferArg::from_raw_parts(base.h.clone(), base.rows * base.cols),
                BufferArg::from_raw_parts(out.h.clone(), total),
                u(n),
                u(e),
                u(kernel),
                u(group),
                u(side),
                0,
            );
        }
    }

    fn resize(&self, t: &mut CubeTensor, rows: usize, cols: usize) {
        let n = rows * cols;
        if n > t.cap {
            t.h = self.empty_f32(n);
            t.cap = n;
        }
        t.rows = rows;
        t.cols = cols;
    }

    fn copy_rows(&self, src: &CubeTensor, rows: &CubeIndex, out: &mut CubeTensor) {
        let n = rows.host.len();
        self.resize(out, n, src.cols);
        assert!(
            rows.below(src.rows),
            "copy_rows: row {:?} of {}",
            rows.max,
            src.rows
        );
        self.gather(
            &src.h, src.cols, &rows.h, n, &out.h, src.cols, src.cols, src.cols, 0,
        );
    }

    fn put_rows(&self, src: &CubeTensor, rows: &CubeIndex, dst: &mut CubeTensor) {
        assert!(
            src.rows == rows.host.len() && src.cols == dst.cols,
            "put_rows: {} rows of {} values into rows of {}",
            src.rows,
            src.cols,
            dst.cols
        );
        assert!(
            rows.below(dst.rows),
            "put_rows: row {:?} of {}",
            rows.max,
            dst.rows
        );
        let n = src.rows * src.cols;
        if n == 0 {
            return;
        }
        // SAFETY: every index row lies inside `dst` (checked) and `src` holds `n` values.
        unsafe {
            ew::scatter::launch(
                &self.client,
                self.ew_count(n),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(src.h.clone(), n),
                BufferArg::from_raw_parts(rows.h.clone(), rows.host.len()),
                BufferArg::from_raw_parts(dst.h.clone(), dst.rows * dst.cols),
                u(n),
                u(src.cols),
            );
        }
    }

    fn get_rows(&self, table: &CubeWeight, ids: &CubeIndex, out: &mut CubeTensor) {
        let cols = table.n_in;
        let n_ids = ids.host.len();
        self.resize(out, n_ids, cols);
        assert!(
            ids.below(table.n_out),
            "get_rows: id {:?} of {} rows in `{}`",
            ids.max,
            table.n_out,
            table.name
        );
        match &table.data {
            // A view's rows start `row0` rows into the buffer.
            WeightData::F32(h) => self.gather(
                h,
                cols,
                &ids.h,
                n_ids,
                &out.h,
                cols,
                cols,
                cols,
                table.row0 * cols,
            ),
            WeightData::Groups {
                fmt,
                codes,
                bd,
                bm,
                gsc,
                gmn,
            } => {
                let n = n_ids * cols;
                if n == 0 {
                    return;
                }
                // SAFETY: the ids are rows of the table (checked above); `out` holds `n`.
                unsafe {
                    at::get_rows_blocks::launch(
                        &self.client,
                        self.ew_count(n),
                        CubeDim::new_1d(self.ew),
                        BufferArg::from_raw_parts(codes.clone(), 1),
                        BufferArg::from_raw_parts(bd.clone(), 1),
                        BufferArg::from_raw_parts(bm.clone(), 1),
                        BufferArg::from_raw_parts(gsc.clone(), 1),
                        BufferArg::from_raw_parts(gmn.clone(), 1),
                        BufferArg::from_raw_parts(self.nl_tab.clone(), 32),
                        BufferArg::from_raw_parts(ids.h.clone(), n_ids),
                        BufferArg::from_raw_parts(out.h.clone(), n),
                        u(n),
                        u(cols),
                        u(table.row0),
                        0,
                        fmt.bits,
                        fmt.group,
                        fmt.block,
                        fmt.offset,
                        fmt.term.code(),
                        fmt.table.code(),
                    );
                }
            }
        }
    }

    fn matmul(&self, x: &CubeTensor, w: &CubeWeight, out: &mut CubeTensor) {
        assert_eq!(
            x.cols, w.n_in,
            "matmul: x has {} columns, `{}` takes {}",
            x.cols, w.name, w.n_in
        );
        self.resize(out, x.rows, w.n_out);
        self.launch_matmul(x, w, None, out);
    }

    fn add_vector(&self, x: &mut CubeTensor, b: &CubeWeight) {
        let Some(bh) = b.floats() else {
            panic!(
                "add_vector: bias `{}` is {} (or a view), not a float vector",
                b.name, b.ty
            );
        };
        assert_eq!(b.n_in * b.n_out, x.cols, "add_vector: bias length");
        self.elementwise(6, &x.h, bh, &x.h, x.rows * x.cols, 0.0, x.cols);
    }

    fn rms_norm(&self, x: &CubeTensor, w: Option<&CubeWeight>, eps: f32, out: &mut CubeTensor) {
        self.resize(out, x.rows, x.cols);
        let wh = w.map(|w| match w.floats() {
            Some(h) => h.clone(),
            None => panic!("rms_norm: weight `{}` is {} (or a view)", w.name, w.ty),
        });
        self.norm(&x.h, wh, &out.h, x.rows, x.cols, eps);
    }

    fn rms_norm_groups(&self, x: &mut CubeTensor, group: usize, w: &CubeWeight, eps: f32) {
        let Some(h) = w.floats() else {
            panic!(
                "rms_norm_groups: weight `{}` is {} (or a view)",
                w.name, w.ty
            );
        };
        assert!(
            group > 0 && x.cols.is_multiple_of(group),
            "rms_norm_groups: {} columns in groups of {group}",
            x.cols
        );
        self.norm(
            &x.h,
            Some(h.clone()),
            &x.h,
            x.rows * x.cols / group,
            group,
            eps,
        );
    }

    fn rope(&self, x: &mut CubeTensor, head_dim: usize, pos: &CubeIndex, cfg: &RopeConfig) {
        assert_eq!(
            pos.host.len(),
            x.rows,
            "rope: {} positions for {} rows",
            pos.host.len(),
            x.rows
        );
        assert!(
            head_dim > 0 && x.cols.is_multiple_of(head_dim),
            "rope: rows are not whole heads"
        );
        assert!(
            cfg.n_rot.is_multiple_of(2) && cfg.n_rot <= head_dim,
            "rope: n_rot {}",
            cfg.n_rot
        );
        let heads = x.cols / head_dim;
        let n = x.rows * heads * cfg.n_rot / 2;
        if n == 0 {
            return;
        }
        let table = self.rope_table(pos, cfg);
        // SAFETY: the table holds `n_rot` values per row; pairs index inside each head.
        unsafe {
            ew::rope::launch(
                &self.client,
                self.ew_count(n),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(x.h.clone(), x.rows * x.cols),
                BufferArg::from_raw_parts(table, x.rows * cfg.n_rot),
                u(n),
                u(heads),
                u(head_dim),
                u(cfg.n_rot),
                0,
                cfg.kind == RopeKind::Neox,
            );
        }
    }

    fn swiglu(&self, gate: &CubeTensor, up: &CubeTensor, out: &mut CubeTensor) {
        Self::check_same("swiglu", gate, up);
        self.resize(out, gate.rows, gate.cols);
        self.elementwise(
            0,
            &gate.h,
            &up.h,
            &out.h,
            gate.rows * gate.cols,
            0.0,
            gate.cols,
        );
    }

    fn geglu(&self, gate: &CubeTensor, up: &CubeTensor, out: &mut CubeTensor) {
        Self::check_same("geglu", gate, up);
        self.resize(out, gate.rows, gate.cols);
        self.elementwise(1, &gate.h, &up.h, &out.h, gate.rows * gate.cols, 0.0, 1);
    }

    fn add(&self, a: &mut CubeTensor, b: &CubeTensor) {
        Self::check_same("add", a, b);
        self.elementwise(2, &a.h, &b.h, &a.h, a.rows * a.cols, 0.0, 1);
    }

    fn scale(&self, a: &mut CubeTensor, s: f32) {
        self.elementwise(3, &a.h, &a.h, &a.h, a.rows * a.cols, s, 1);
    }

    fn put_cols(&self, src: &CubeTensor, col0: usize, dst: &mut CubeTensor) {
        assert!(
            src.rows == dst.rows && col0 + src.cols <= dst.cols,
            "put_cols: {} rows of {} values at column {col0} of {} rows of {}",
            src.rows,
            src.cols,
            dst.rows,
            dst.cols
        );
        let n = src.rows * src.cols;
        if n == 0 {
            return;
        }
        // SAFETY: `src` holds `n` values and every write lands in row `r < dst.rows` at a
        // column below `col0 + src.cols ≤ dst.cols` (checked).
        unsafe {
            ew::put_cols::launch(
                &self.client,
                self.ew_count(n),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(src.h.clone(), n),
                BufferArg::from_raw_parts(dst.h.clone(), dst.rows * dst.cols),
                u(n),
                u(src.cols),
                u(dst.cols),
                u(col0),
            );
        }
    }

    fn clamp_finite(&self, x: &mut CubeTensor, limit: f32) {
        self.elementwise(9, &x.h, &x.h, &x.h, x.rows * x.cols, limit, 1);
    }

    fn softcap(&self, x: &mut CubeTensor, c: f32) {
        self.elementwise(4, &x.h, &x.h, &x.h, x.rows * x.cols, c, 1);
    }

    fn silu(&self, x: &mut CubeTensor) {
        self.elementwise(5, &x.h, &x.h, &x.h, x.rows * x.cols, 0.0, 1);
    }

    fn gate_mul(&self, x: &mut CubeTensor, gate: &CubeTensor, act: GateAct) {
        assert_eq!(x.rows, gate.rows, "gate_mul: rows");
        assert!(
            gate.cols > 0 && x.cols.is_multiple_of(gate.cols),
            "gate_mul: {} columns gated by {}",
            x.cols,
            gate.cols
        );
        let op = match act {
            GateAct::Sigmoid => 7,
            GateAct::Softplus => 8,
        };
        self.elementwise(
            op,
            &x.h,
            &gate.h,
            &x.h,
            x.rows * x.cols,
            0.0,
            x.cols / gate.cols,
        );
    }

    fn gather_cols(
        &self,
        src: &CubeTensor,
        stride: usize,
        range: std::ops::Range<usize>,
        out: &mut CubeTensor,
    ) {
        assert!(
            stride > 0 && src.cols.is_multiple_of(stride) && range.end <= stride,
            "gather_cols: range {range:?} of groups of {stride}"
        );
        let width = range.len();
        let cols = src.cols / stride * width;
        self.resize(out, src.rows, cols);
        let idx = self.iota(src.rows);
        self.gather(
            &src.h,
            src.cols,
            &idx,
            src.rows,
            &out.h,
            cols,
            width.max(1),
            stride,
            range.start,
        );
    }

    fn routes(&self) -> CubeRoutes {
        CubeRoutes {
            ids: self.client.empty(4),
            w: self.empty_f32(1),
            n: 0,
            n_used: 0,
            n_expert: 0,
            cap: 1,
        }
    }

    fn moe_route(
        &self,
        logits: &CubeTensor,
        p: &MoeRoute,
        bias: Option<&CubeWeight>,
        out: &mut CubeRoutes,
    ) {
        let (n, ne) = (logits.rows, logits.cols);
        assert!(
            p.n_used >= 1 && p.n_used <= ne,
            "moe_route: {} experts used of {ne}",
            p.n_used
        );
        let bh = bias.map(|b| match b.floats() {
            Some(h) if b.n_in * b.n_out == ne => h.clone(),
            _ => panic!(
                "moe_route: bias `{}` must be a float vector of {ne} values",
                b.name
            ),
        });
        let pairs = n * p.n_used;
        if pairs > out.cap {
            out.ids = self.client.empty(pairs * 4);
            out.w = self.empty_f32(pairs);
            out.cap = pairs;
        }
        (out.n, out.n_used, out.n_expert) = (n, p.n_used, ne);
        if n == 0 {
            return;
        }
        let probs = self.empty_f32(n * ne);
        let has_bias = bh.is_some();
        // SAFETY: `logits` and `probs` are `[n, ne]`, the bias `ne` values where read, the
        // routing's buffers hold `n · n_used` pairs (`n_used ≤ ne`, checked).
        unsafe {
            moe::moe_route::launch(
                &self.client,
                CubeCount::Static(u(n), 1, 1),
                CubeDim::new_1d(u(self.units)),
                BufferArg::from_raw_parts(logits.h.clone(), n * ne),
                BufferArg::from_raw_parts(bh.unwrap_or_else(|| self.unused.clone()), 1),
                BufferArg::from_raw_parts(self.exp_tab.clone(), 32),
                BufferArg::from_raw_parts(probs, n * ne),
                BufferArg::from_raw_parts(out.ids.clone(), pairs),
                BufferArg::from_raw_parts(out.w.clone(), pairs),
                u(ne),
                u(p.n_used),
                p.scale,
                0,
                p.sigmoid,
                p.norm,
                has_bias,
                self.units,
            );
        }
    }

    fn routes_to_host(&self, r: &CubeRoutes, ids: &mut Vec<u32>, w: &mut Vec<f32>) {
        ids.clear();
        w.clear();
        let pairs = r.n * r.n_used;
        if pairs == 0 {
            return;
        }
        let read = |h: &Handle| {
            self.client
                .read_one(h.clone())
                .unwrap_or_else(|e| panic!("{} backend: a kernel failed: {e:?}", self.name))
        };
        ids.extend_from_slice(&u32::from_bytes(&read(&r.ids))[..pairs]);
        w.extend_from_slice(&f32::from_bytes(&read(&r.w))[..pairs]);
    }

    fn matmul_id(
        &self,
        x: &CubeTensor,
        experts: &[CubeWeight],
        scales: Option<&[f32]>,
        r: &CubeRoutes,
        per_pair: bool,
        out: &mut CubeTensor,
    ) {
        let pairs = r.n * r.n_used;
        let n_used = r.n_used.max(1);
        let want = if per_pair { pairs } else { r.n };
        assert_eq!(
            x.rows, want,
            "matmul_id: x has {} rows for {pairs} pairs of {n_used}",
            x.rows
        );
        let Some(first) = experts.first() else {
            assert_eq!(pairs, 0, "matmul_id: pairs routed to no expert");
            self.resize(out, 0, 0);
            return;
        };
        let (n_in, n_out) = (first.n_in, first.n_out);
        assert_eq!(x.cols, n_in, "matmul_id: x has {} columns", x.cols);
        for w in experts {
            assert_eq!(
                (w.n_in, w.n_out),
                (n_in, n_out),
                "matmul_id: expert `{}` has another shape",
                w.name
            );
        }
        // Every id the routing holds is below `n_expert`: checked here, on the host, so the
        // routed launch reads no id back.
        assert!(
            r.n_expert <= experts.len(),
            "matmul_id: a routing over {} experts, {} given",
            r.n_expert,
            experts.len()
        );
        if let Some(s) = scales {
            assert_eq!(s.len(), experts.len(), "matmul_id: one scale per expert");
        }
        self.resize(out, pairs, n_out);
        if pairs == 0 || n_out == 0 {
            return;
        }
        if pairs <= ROUTED_PAIRS
            && let Some(stride) = one_stack(experts)
        {
            let route = Routed {
                ids: r.ids.clone(),
                scales: scales.map(|s| self.upload_f32(s)),
                stride,
                div: if per_pair { 1 } else { n_used },
            };
            self.launch_matmul(x, first, Some(&route), out);
            return;
        }
        // Each expert's pairs as one tiled matmul over its rows: the matmul gives a row the
        // bits it has alone, so these are the routed launch's.
        let (mut ids, mut w) = (Vec::new(), Vec::new());
        self.routes_to_host(r, &mut ids, &mut w);
        let mut by: Vec<Vec<u32>> = vec![Vec::new(); experts.len()];
        for (p, &e) in (0u32..).zip(&ids) {
            by[e as usize].push(p);
        }
        let div = u(if per_pair { 1 } else { n_used });
        let (mut xs, mut ys) = (self.zeros(0, 0), self.zeros(0, 0));
        for (e, ps) in by.iter().enumerate() {
            if ps.is_empty() {
                continue;
            }
            let src: Vec<u32> = ps.iter().map(|&p| p / div).collect();
            self.copy_rows(x, &self.index(&src), &mut xs);
            self.matmul(&xs, &experts[e], &mut ys);
            if let Some(s) = scales {
                self.scale(&mut ys, s[e]);
            }
            self.put_rows(&ys, &self.index(ps), out);
        }
    }

    fn moe_combine(&self, y: &CubeTensor, r: &CubeRoutes, out: &mut CubeTensor) {
        let pairs = r.n * r.n_used;
        assert_eq!(
            y.rows, pairs,
            "moe_combine: y has {} rows for {pairs} pairs",
            y.rows
        );
        self.resize(out, r.n, y.cols);
        let total = r.n * y.cols;
        if total == 0 {
            return;
        }
        // SAFETY: `y` is `[n · n_used, cols]`, the weights `n · n_used`, `out` `[n, cols]`.
        unsafe {
            moe::moe_combine::launch(
                &self.client,
                self.ew_count(total),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(y.h.clone(), pairs * y.cols),
                BufferArg::from_raw_parts(r.w.clone(), pairs),
                BufferArg::from_raw_parts(out.h.clone(), total),
                u(total),
                u(y.cols),
                u(r.n_used),
                0,
            );
        }
    }

    fn kv_new(&self, shape: KvShape) -> Result<CubeKv> {
        let unsupported = |what: String| TensorError::Unsupported {
            backend: self.name,
            what,
        };
        let mut layers = Vec::with_capacity(shape.n_layer);
        let recurrent = match &shape.recurrent {
            Some(r) => {
                if r.layers.len() != shape.n_layer {
                    return Err(TensorError::Shape {
                        op: "kv_new",
                        detail: format!(
                            "recurrent layer list of {} entries for {} layers",
                            r.layers.len(),
                            shape.n_layer
                        ),
                    });
                }
                r.layers
                    .iter()
                    .map(|l| {
                        l.map(|sh| RecurrentKv {
                            shape: sh,
                            conv: Timeline::new(self, sh.conv_len(), r.snapshots),
                            ssm: Timeline::new(self, sh.state_len(), r.snapshots),
                        })
                    })
                    .collect()
            }
            None => (0..shape.n_layer).map(|_| None).collect(),
        };
        for l in 0..shape.n_layer {
            let (kt, vt) = shape.layer_types(l);
            let hd = shape.layer_heads(l);
            let cells = shape.layer_cells(l);
            let refuse = || {
                unsupported(format!(
                    "the cache formats -ctk {kt} -ctv {vt} (layer {l}) yet: its caches are {CACHE_FORMATS} (f16 and f32 not mixed)"
                ))
            };
            let float = |ty| matches!(ty, QType::F16 | QType::F32);
            let f16 = match (float(kt), float(vt)) {
                (true, true) if kt != vt => return Err(refuse()),
                (true, _) => kt == QType::F16,
                (false, true) => vt == QType::F16,
                (false, false) => true,
            };
            let esz = if f16 { 2 } else { 4 };
            let plane = |ty: QType, head_dim: usize, v: bool| -> Result<Plane> {
                let width = hd.n_kv_head * head_dim;
                if float(ty) {
                    return Ok(Plane::Float(
                        self.client.empty((cells * width * esz).max(4)),
                    ));
                }
                if let Some(bits) = match ty {
                    QType::Turbo2 => Some(2u32),
                    QType::Turbo3 => Some(3),
                    QType::Turbo4 => Some(4),
                    _ => None,
                } {
                    // Heads of whole 128-value groups, or of 64 values in two stages; heads
                    // padded to 128 (refined on the CPU backend) are not kept here.
                    let two = if head_dim == 64 {
                        Some(TwoStage::new(self, ty).ok_or_else(refuse)?)
                    } else if head_dim > 0 && head_dim.is_multiple_of(128) {
                        None
                    } else {
                        return Err(refuse());
                    };
                    let dim = if two.is_some() { 128 } else { head_dim };
                    let groups = cells * hd.n_kv_head * dim / 128;
                    return Ok(Plane::Turbo(Box::new(TurboPlane {
                        bits,
                        dim,
                        codes: self.client.empty((groups * 4 * bits as usize * 4).max(4)),
                        norms: self.empty_f32(groups),
                        center: self.empty_f32(width),
                        calibrated: false,
                        two,
                    })));
                }
                let fmt = GroupFormat::of(ty)
                    .filter(|f| {
                        f.block == 32
                            && matches!(f.table, layout::Table::None | layout::Table::Iq4Nl)
                            && head_dim.is_multiple_of(32)
                    })
                    .ok_or_else(refuse)?;
                let had = match if v {
                    specula_kv::v_rotation(ty, head_dim)
                } else {
                    specula_kv::k_rotation(ty, head_dim)
                } {
                    specula_kv::Rotation::Hadamard(n) => n,
                    _ => 0,
                };
                let blocks = cells * width / 32;
                Ok(Plane::Blocks(Box::new(BlockPlane {
                    fmt,
                    codes: self.client.empty((blocks * fmt.words() * 4).max(4)),
                    d: self.empty_f32(blocks),
                    m: self.empty_f32(if fmt.block_min() { blocks } else { 0 }),
                    center: self.empty_f32(width),
                    calibrated: false,
                    had,
                    hscale: hadamard_scale(had),
                })))
            };
            layers.push(LayerKv {
                k: plane(kt, hd.head_dim_k, false)?,
                v: plane(vt, hd.head_dim_v, true)?,
                f16,
                cells,
                n_kv_head: hd.n_kv_head,
                hd_k: hd.head_dim_k,
                hd_v: hd.head_dim_v,
            });
        }
        Ok(CubeKv {
            n_ctx: shape.n_ctx,
            layers,
            recurrent,
        })
    }

    fn kv_write(
        &self,
        kv: &mut CubeKv,
        layer: usize,
        cells: &CubeIndex,
        k: &CubeTensor,
        v: &CubeTensor,
    ) {
        let l = &kv.layers[layer];
        assert!(
            cells.below(l.cells),
            "kv_write: cell {:?} of {} in layer {layer}",
            cells.max,
            l.cells
        );
        let ih = cells.h.clone();
        let cells = &cells.host;
        let l = &mut kv.layers[layer];
        let (f16, n_cells, n_kv) = (l.f16, l.cells, l.n_kv_head);
        for (src, dst, hd) in [(k, &mut l.k, l.hd_k), (v, &mut l.v, l.hd_v)] {
            let width = n_kv * hd;
            assert_eq!(
                (src.rows, src.cols),
                (cells.len(), width),
                "kv_write: rows of layer {layer}"
            );
            let n = cells.len() * width;
            if n == 0 {
                continue;
            }
            match dst {
                Plane::Float(h) => {
                    // SAFETY: cells are inside the layer (checked); `src` is `[cells, width]`.
                    unsafe {
                        let args = (
                            BufferArg::from_raw_parts(src.h.clone(), n),
                            BufferArg::from_raw_parts(ih.clone(), cells.len()),
                            BufferArg::from_raw_parts(h.clone(), n_cells * width),
                        );
                        if f16 {
                            at::kv_write::launch::<half::f16>(
                                &self.client,
                                self.ew_count(n),
                                CubeDim::new_1d(self.ew),
                                args.0,
                                args.1,
                                args.2,
                                u(n),
                                u(width),
                            );
                        } else {
                            at::kv_write::launch::<f32>(
                                &self.client,
                                self.ew_count(n),
                                CubeDim::new_1d(self.ew),
                                args.0,
                                args.1,
                                args.2,
                                u(n),
                                u(width),
                            );
                        }
                    }
                }
                Plane::Blocks(p) => {
                    self.calibrate(&mut p.calibrated, &p.center, src);
                    let items = cells.len() * n_kv;
                    let blocks = n_cells * width / 32;
                    let work = self.empty_f32(n);
                    let (bits, offset, term) = p.code();
                    // SAFETY: cells are inside the layer (checked); `src` is `[cells, width]`,
                    // `work` as long; the plane holds `blocks` blocks of `bits` words.
                    unsafe {
                        kq::kv_write_blocks::launch(
                            &self.client,
                            self.ew_count(items),
                            CubeDim::new_1d(self.ew),
                            BufferArg::from_raw_parts(src.h.clone(), n),
                            BufferArg::from_raw_parts(ih.clone(), cells.len()),
                            BufferArg::from_raw_parts(p.center.clone(), width),
                            BufferArg::from_raw_parts(p.codes.clone(), blocks * bits as usize),
                            BufferArg::from_raw_parts(p.d.clone(), blocks),
                            BufferArg::from_raw_parts(
                                p.m.clone(),
                                if p.fmt.block_min() { blocks } else { 1 },
                            ),
                            BufferArg::from_raw_parts(work, n),
                            BufferArg::from_raw_parts(self.nl_tab.clone(), 32),
                            u(items),
                            u(n_kv),
                            u(hd),
                            u(p.had),
                            p.hscale,
                            0,
                            bits,
                            offset,
                            term,
                            p.fmt.table.code(),
                        );
                    }
                }
                Plane::Turbo(p) => {
                    self.calibrate(&mut p.calibrated, &p.center, src);
                    let items = cells.len() * n_kv;
                    let groups = n_cells * n_kv * p.dim / 128;
                    let work = self.empty_f32(n);
                    if let Some(two) = &p.two {
                        // SAFETY: cells are inside the layer (checked); `src` is
                        // `[cells, n_kv · 64]`, `work` as long; the plane holds one group of
                        // `4 · bits` words per (cell, head); the tables as `TwoStage` built
                        // them for `nl` levels.
                        unsafe {
                            kq::kv_write_turbo2s::launch(
                                &self.client,
                                self.ew_count(items),
                                CubeDim::new_1d(self.ew),
                                BufferArg::from_raw_parts(src.h.clone(), n),
                                BufferArg::from_raw_parts(ih.clone(), cells.len()),
                                BufferArg::from_raw_parts(p.center.clone(), width),
                                BufferArg::from_raw_parts(
                                    p.codes.clone(),
                                    groups * 4 * p.bits as usize,
                                ),
                                BufferArg::from_raw_parts(p.norms.clone(), groups),
                                BufferArg::from_raw_parts(work, n),
                                BufferArg::from_raw_parts(self.turbo_tab.clone(), 1),
                                BufferArg::from_raw_parts(two.lf.clone(), 1),
                                BufferArg::from_raw_parts(two.lu.clone(), 1),
                                u(items),
                                u(n_kv),
                                two.steps,
                                0,
                                p.bits,
                                two.nl,
                            );
                        }
                        continue;
                    }
                    // SAFETY: cells are inside the layer (checked); `src` is `[cells, width]`,
                    // `work` as long; the plane holds `groups` groups of `4 · bits` words.
                    unsafe {
                        kq::kv_write_turbo::launch(
                            &self.client,
                            self.ew_count(items),
                            CubeDim::new_1d(self.ew),
                            BufferArg::from_raw_parts(src.h.clone(), n),
                            BufferArg::from_raw_parts(ih.clone(), cells.len()),
                            BufferArg::from_raw_parts(p.center.clone(), width),
                            BufferArg::from_raw_parts(
                                p.codes.clone(),
                                groups * 4 * p.bits as usize,
                            ),
                            BufferArg::from_raw_parts(p.norms.clone(), groups),
                            BufferArg::from_raw_parts(work, n),
                            BufferArg::from_raw_parts(self.turbo_tab.clone(), 1),
                            u(items),
                            u(n_kv),
                            u(hd),
                            0,
                            p.bits,
                        );
                    }
                }
            }
        }
    }

    fn ssm_conv(
        &self,
        kv: &mut CubeKv,
        layer: usize,
        pos0: usize,
        x: &CubeTensor,
        w: &CubeWeight,
        out: &mut CubeTensor,
    ) {
        let Some(Some(mem)) = kv.recurrent.get_mut(layer) else {
            panic!("ssm_conv: layer {layer} of the cache is not recurrent")
        };
        let (kernel, ch) = (mem.shape.conv_kernel, mem.shape.conv_channels);
        assert_eq!(x.cols, ch, "ssm_conv: rows of {ch} channels");
        assert_eq!(
            (w.n_in, w.n_out),
            (kernel, ch),
            "ssm_conv: weight `{}` must be [{kernel}, {ch}]",
            w.name
        );
        let Some(wh) = w.floats() else {
            panic!(
                "ssm_conv: weight `{}` is {} (or a view): convolution taps are float ({kernel} per channel is not a whole block)",
                w.name, w.ty
            )
        };
        let n = x.rows;
        self.resize(out, n, ch);
        let t = &mut mem.conv;
        t.begin(self, pos0, n, "ssm_conv");
        if n > 0 {
            // SAFETY: `x` and `out` are `[n, ch]`, the taps `[ch, kernel]`, the state
            // `(kernel − 1) · ch` values and the snapshots `keep` states.
            unsafe {
                rec::ssm_conv::launch(
                    &self.client,
                    self.ew_count(ch),
                    CubeDim::new_1d(self.ew),
                    BufferArg::from_raw_parts(x.h.clone(), n * ch),
                    BufferArg::from_raw_parts(wh.clone(), kernel * ch),
                    BufferArg::from_raw_parts(t.cur.clone(), t.len.max(1)),
                    BufferArg::from_raw_parts(t.snaps.clone(), (t.keep() * t.len).max(1)),
                    BufferArg::from_raw_parts(out.h.clone(), n * ch),
                    u(n),
                    u(ch),
                    u(kernel),
                    u(t.keep()),
                    0,
                );
            }
        }
        t.end(n);
    }

    #[allow(clippy::too_many_lines, reason = "the rule's three kernels in order")]
    fn gated_delta_net(
        &self,
        kv: &mut CubeKv,
        p: &DeltaNetParams,
        q: &CubeTensor,
        k: &CubeTensor,
        v: &CubeTensor,
        alpha: &CubeTensor,
        beta: &CubeTensor,
        dt_bias: &CubeWeight,
        a: &CubeWeight,
        out: &mut CubeTensor,
    ) {
        let Some(Some(mem)) = kv.recurrent.get_mut(p.layer) else {
            panic!(
                "gated_delta_net: layer {} of the cache is not recurrent",
                p.layer
            )
        };
        let sh = mem.shape;
        let (hk, hv, d) = (sh.n_head_k, sh.n_head_v, sh.head_dim);
        let n = q.rows;
        assert!(
            (k.rows, v.rows, alpha.rows, beta.rows) == (n, n, n, n)
                && q.cols == hk * d
                && k.cols == hk * d
                && v.cols == hv * d
                && alpha.cols == hv
                && beta.cols == hv,
            "gated_delta_net: q, k [n, {hk}·{d}], v [n, {hv}·{d}], alpha and beta [n, {hv}]"
        );
        let vector = |w: &CubeWeight| match w.floats() {
            Some(h) if w.n_in * w.n_out == hv => h.clone(),
            _ => panic!(
                "gated_delta_net: `{}` must be a float vector of {hv} values",
                w.name
            ),
        };
        let (dth, ah) = (vector(dt_bias), vector(a));
        self.resize(out, n, hv * d);
        let t = &mut mem.ssm;
        t.begin(self, p.pos0, n, "gated_delta_net");
        if n > 0 {
            let (qn, kn) = (self.empty_f32(n * hk * d), self.empty_f32(n * hk * d));
            let (decay, strength) = (self.empty_f32(n * hv), self.empty_f32(n * hv));
            #[allow(
                clippy::cast_precision_loss,
                reason = "a head size, as ggml converts it"
            )]
            let scale = 1.0 / (d as f32).sqrt();
            // SAFETY: `q`, `k` are `[n, hk · d]`, `v` and `out` `[n, hv · d]`, `alpha`,
            // `beta` `[n, hv]`, the vectors `hv` values; the state `hv · d · d` values and the
            // snapshots `keep` states; the scratch as allocated above.
            unsafe {
                rec::delta_norm::launch(
                    &self.client,
                    self.ew_count(n * hk),
                    CubeDim::new_1d(self.ew),
                    BufferArg::from_raw_parts(q.h.clone(), n * hk * d),
                    BufferArg::from_raw_parts(k.h.clone(), n * hk * d),
                    BufferArg::from_raw_parts(qn.clone(), n * hk * d),
                    BufferArg::from_raw_parts(kn.clone(), n * hk * d),
                    u(n * hk),
                    u(d),
                    p.eps,
                    scale,
                    0,
                );
                rec::delta_gates::launch(
                    &self.client,
                    self.ew_count(n * hv),
                    CubeDim::new_1d(self.ew),
                    BufferArg::from_raw_parts(alpha.h.clone(), n * hv),
                    BufferArg::from_raw_parts(beta.h.clone(), n * hv),
                    BufferArg::from_raw_parts(dth, hv),
                    BufferArg::from_raw_parts(ah, hv),
                    BufferArg::from_raw_parts(self.exp_tab.clone(), 32),
                    BufferArg::from_raw_parts(decay.clone(), n * hv),
                    BufferArg::from_raw_parts(strength.clone(), n * hv),
                    u(n * hv),
                    u(hv),
                );
                rec::delta_rule::launch(
                    &self.client,
                    self.ew_count(hv * d),
                    CubeDim::new_1d(self.ew),
                    BufferArg::from_raw_parts(qn, n * hk * d),
                    BufferArg::from_raw_parts(kn, n * hk * d),
                    BufferArg::from_raw_parts(v.h.clone(), n * hv * d),
                    BufferArg::from_raw_parts(decay, n * hv),
                    BufferArg::from_raw_parts(strength, n * hv),
                    BufferArg::from_raw_parts(t.cur.clone(), t.len),
                    BufferArg::from_raw_parts(t.snaps.clone(), (t.keep() * t.len).max(1)),
                    BufferArg::from_raw_parts(out.h.clone(), n * hv * d),
                    u(n),
                    u(hk),
                    u(hv),
                    u(d),
                    u(t.keep()),
                    0,
                    sh.grouped,
                );
            }
        }
        t.end(n);
    }

    fn kv_export(&self, kv: &CubeKv, n: usize, out: &mut Vec<u8>) -> Result<()> {
        if n > kv.n_ctx {
            return Err(TensorError::Shape {
                op: "kv_export",
                detail: format!("exporting {n} positions of a {}-position cache", kv.n_ctx),
            });
        }
        for r in kv.recurrent.iter().flatten() {
            let seen = r.conv.pos.position();
            if seen != n {
                return Err(TensorError::Shape {
                    op: "kv_export",
                    detail: format!(
                        "exporting {n} positions of a recurrent layer whose state is that of {seen}"
                    ),
                });
            }
        }
        out.extend_from_slice(KV_TAG);
        for l in &kv.layers {
            let cells = n.min(l.cells);
            let esz = if l.f16 { 2 } else { 4 };
            for (pl, hd) in [(&l.k, l.hd_k), (&l.v, l.hd_v)] {
                for (h, bytes) in pl.prefix(cells, l.n_kv_head, hd, esz) {
                    self.read_prefix(h, bytes, out);
                }
                if let Plane::Blocks(b) = pl {
                    out.push(u8::from(b.calibrated));
                } else if let Plane::Turbo(t) = pl {
                    out.push(u8::from(t.calibrated));
                }
            }
        }
        for r in kv.recurrent.iter().flatten() {
            for t in [&r.conv, &r.ssm] {
                self.read_prefix(&t.cur, t.len * 4, out);
            }
        }
        Ok(())
    }

    fn kv_import(&self, kv: &mut CubeKv, n: usize, bytes: &[u8]) -> Result<()> {
        let bad = |detail: String| TensorError::Shape {
            op: "kv_import",
            detail,
        };
        if n > kv.n_ctx {
            return Err(bad(format!(
                "importing {n} positions into a {}-position cache",
                kv.n_ctx
            )));
        }
        let Some(mut rest) = bytes.strip_prefix(KV_TAG.as_slice()) else {
            return Err(bad(format!(
                "not an export of the {} backend's cache (another backend's, or damaged)",
                self.name
            )));
        };
        let mut take = |len: usize| -> Result<&[u8]> {
            if rest.len() < len {
                return Err(bad(format!(
                    "the export ends early: {len} more bytes wanted, {} left",
                    rest.len()
                )));
            }
            let (a, b) = rest.split_at(len);
            rest = b;
            Ok(a)
        };
        // Read and check everything before writing anything.
        let mut writes: Vec<(Handle, &[u8])> = Vec::new();
        let mut flags: Vec<(usize, bool, bool)> = Vec::new();
        for (il, l) in kv.layers.iter().enumerate() {
            let cells = n.min(l.cells);
            let esz = if l.f16 { 2 } else { 4 };
            for (iv, (pl, hd)) in [(&l.k, l.hd_k), (&l.v, l.hd_v)].into_iter().enumerate() {
                for (h, len) in pl.prefix(cells, l.n_kv_head, hd, esz) {
                    writes.push((h.clone(), take(len)?));
                }
                if pl.center().is_some() {
                    flags.push((il, iv == 1, take(1)?[0] != 0));
                }
            }
        }
        for r in kv.recurrent.iter().flatten() {
            for t in [&r.conv, &r.ssm] {
                writes.push((t.cur.clone(), take(t.len * 4)?));
            }
        }
        if !rest.is_empty() {
            return Err(bad(format!(
                "{} bytes past the export of {n} positions",
                rest.len()
            )));
        }
        for (h, b) in writes {
            self.write_prefix(&h, b)?;
        }
        for (il, v, c) in flags {
            let l = &mut kv.layers[il];
            let pl = if v { &mut l.v } else { &mut l.k };
            if let Some(f) = pl.calibrated_mut() {
                *f = c;
            }
        }
        for r in kv.recurrent.iter_mut().flatten() {
            for t in [&mut r.conv, &mut r.ssm] {
                self.copy(&t.cur, 0, &t.before, 0, t.len);
                t.pos.reset_to(n);
            }
        }
        Ok(())
    }

    fn kv_holds(&self, kv: &CubeKv, pos: usize) -> bool {
        kv.recurrent
            .iter()
            .flatten()
            .all(|r| r.conv.pos.holds(pos) && r.ssm.pos.holds(pos))
    }

    fn attention(
        &self,
        q: &CubeTensor,
        kv: &CubeKv,
        p: &AttentionParams<'_, CubeIndex>,
        out: &mut CubeTensor,
    ) {
        let l = &kv.layers[p.layer];
        assert_eq!(q.cols, p.n_head * l.hd_k, "attention: query columns");
        assert_eq!(p.q_pos.host.len(), q.rows, "attention: query positions");
        assert!(
            p.n_head.is_multiple_of(l.n_kv_head),
            "attention: {} heads over {} K/V heads",
            p.n_head,
            l.n_kv_head
        );
        self.resize(out, q.rows, p.n_head * l.hd_v);
        let kv_len = p.kv_pos.host.len();
        if q.rows == 0 {
            return;
        }
        let (mask, window) = match p.mask {
            Mask::Causal => (0, 0),
            Mask::SlidingWindow(w) => (1, u32::try_from(w).unwrap_or(u32::MAX)),
            Mask::None => (2, 0),
        };
        let (qp, kp) = (p.q_pos.h.clone(), p.kv_pos.h.clone());
        let group = p.n_head / l.n_kv_head;
        // Queries for block-format keys: `q·m`, rotated and quantized once per call.
        let none = || self.client.empty(4);
        let (kfmt, vfmt) = (l.k.code(), l.v.code());
        let table = |pl: &Plane| pl.blocks().map_or(0, |b| b.fmt.table.code());
        let (ktable, vtable) = (table(&l.k), table(&l.v));
        let items = q.rows * p.n_head;
        let mut qf = none();
        let (qa, qd, qs, qm) = match &l.k {
            Plane::Turbo(kt) => {
                // Queries for turbo keys: `q·m` and the head rotated forward.
                let qm = self.empty_f32(items);
                qf = self.empty_f32(items * read_width(kt));
                // SAFETY: `q` is `[rows, n_head · hd_k]`; `qf` holds the stored width per
                // head, `qm` one value per head.
                unsafe {
                    kq::attn_query_turbo::launch(
                        &self.client,
                        self.ew_count(items),
                        CubeDim::new_1d(self.ew),
                        BufferArg::from_raw_parts(q.h.clone(), q.rows * q.cols),
                        BufferArg::from_raw_parts(kt.center.clone(), l.n_kv_head * l.hd_k),
                        BufferArg::from_raw_parts(self.turbo_tab.clone(), 1),
                        BufferArg::from_raw_parts(qf.clone(), items * read_width(kt)),
                        BufferArg::from_raw_parts(qm.clone(), items),
                        u(items),
                        u(p.n_head),
                        u(group),
                        u(l.hd_k),
                        kt.two.is_some(),
                    );
                }
                (none(), none(), none(), qm)
            }
            Plane::Blocks(kb) => {
                let nb = items * l.hd_k / 32;
                let (qa, qd, qs, qm) = (
                    self.client.empty(q.rows * q.cols * 4),
                    self.empty_f32(nb),
                    self.empty_f32(nb),
                    self.empty_f32(items),
                );
                // SAFETY: `q` is `[rows, n_head · hd_k]`; the outputs and the scratch hold
                // what the kernel writes for `items` heads.
                unsafe {
                    kq::attn_query_blocks::launch(
                        &self.client,
                        self.ew_count(items),
                        CubeDim::new_1d(self.ew),
                        BufferArg::from_raw_parts(q.h.clone(), q.rows * q.cols),
                        BufferArg::from_raw_parts(kb.center.clone(), l.n_kv_head * l.hd_k),
                        BufferArg::from_raw_parts(self.empty_f32(q.rows * q.cols), q.rows * q.cols),
                        BufferArg::from_raw_parts(qa.clone(), q.rows * q.cols),
                        BufferArg::from_raw_parts(qd.clone(), nb),
                        BufferArg::from_raw_parts(qs.clone(), nb),
                        BufferArg::from_raw_parts(qm.clone(), items),
                        u(items),
                        u(p.n_head),
                        u(group),
                        u(l.hd_k),
                        u(kb.had),
                        kb.hscale,
                        0,
                        kb.fmt.act == ActQuant::Q8_1,
                    );
                }
                (qa, qd, qs, qm)
            }
            Plane::Float(_) => (none(), none(), none(), none()),
        };
        let plane = |pl: &Plane| match pl {
            Plane::Float(h) => (h.clone(), none(), none(), none()),
            Plane::Blocks(b) => (none(), b.codes.clone(), b.d.clone(), b.m.clone()),
            Plane::Turbo(t) => (none(), t.codes.clone(), t.norms.clone(), none()),
        };
        let (k_f, k_c, k_d, k_m) = plane(&l.k);
        let (v_f, v_c, v_d, v_m) = plane(&l.v);
        let v_center = l.v.center().cloned().unwrap_or_else(none);
        let (v_had, v_hscale) = match &l.v {
            Plane::Blocks(b) => (b.had, b.hscale),
            _ => (0, 1.0),
        };
        // Values read per head: the stored width, or a two-stage turbo head's 64.
        let stored = |pl: &Plane, hd: usize| match pl {
            Plane::Turbo(t) => read_width(t),
            _ => hd,
        };
        let (kdim, vdim) = (stored(&l.k, l.hd_k), stored(&l.v, l.hd_v));
        fn two(pl: &Plane) -> Option<&TwoStage> {
            match pl {
                Plane::Turbo(t) => t.two.as_ref(),
                _ => None,
            }
        }
        let (k_two, v_two) = (two(&l.k), two(&l.v));
        // Two-stage values are merged in their read order, then put back in order and
        // rotated back.
        let (target, empty) = match v_two {
            Some(_) => (self.empty_f32(items * vdim), self.client.empty(items * 4)),
            None => (out.h.clone(), none()),
        };
        let n_chunks = kv_len.div_ceil(at::CHUNK).max(1);
        let per_row = p.n_head * n_chunks * (vdim + 2);
        let rows_per_launch = (MAX_SCORES / per_row).max(1);
        let states = self.empty_f32(rows_per_launch.min(q.rows) * per_row);
        let mut r0 = 0;
        while r0 < q.rows {
            let n = rows_per_launch.min(q.rows - r0);
            macro_rules! launch {
                ($e:ty) => {
                    // SAFETY: rows `r0..r0 + n` of `q` and `out`; `kv_pos` entries map to
                    // cells `j % cells` of the layer, whose planes hold every cell (a float
                    // plane its values, a block plane its blocks); the prepared queries hold
                    // `q.rows · n_head` heads; `states` holds
                    // `n · n_head · n_chunks · (hd_v + 2)` values. The kernel reads only
                    // the buffers of the formats it is compiled for.
                    unsafe {
                        at::attn_chunk::launch::<$e>(
                            &self.client,
                            CubeCount::Static(u(n * p.n_head), u(n_chunks), 1),
                            CubeDim::new_1d(u(self.units)),
                            BufferArg::from_raw_parts(q.h.clone(), q.rows * q.cols),
                            BufferArg::from_raw_parts(k_f.clone(), 1),
                            BufferArg::from_raw_parts(v_f.clone(), 1),
                            BufferArg::from_raw_parts(k_c.clone(), 1),
                            BufferArg::from_raw_parts(k_d.clone(), 1),
                            BufferArg::from_raw_parts(k_m.clone(), 1),
                            BufferArg::from_raw_parts(v_c.clone(), 1),
                            BufferArg::from_raw_parts(v_d.clone(), 1),
                            BufferArg::from_raw_parts(v_m.clone(), 1),
                            BufferArg::from_raw_parts(qa.clone(), 1),
                            BufferArg::from_raw_parts(qd.clone(), 1),
                            BufferArg::from_raw_parts(qs.clone(), 1),
                            BufferArg::from_raw_parts(qm.clone(), 1),
                            BufferArg::from_raw_parts(qf.clone(), 1),
                            BufferArg::from_raw_parts(self.turbo_tab.clone(), 1),
                            BufferArg::from_raw_parts(self.nl_tab.clone(), 32),
                            BufferArg::from_raw_parts(qp.clone(), q.rows),
                            BufferArg::from_raw_parts(kp.clone(), kv_len.max(1)),
                            BufferArg::from_raw_parts(self.exp_tab.clone(), 32),
                            BufferArg::from_raw_parts(states.clone(), n * per_row),
                            u(r0),
                            u(kv_len),
                            u(l.cells),
                            u(p.n_head),
                            u(group),
                            u(kdim),
                            u(vdim),
                            p.scale,
                            p.softcap.unwrap_or(1.0),
                            window,
                            0,
                            k_two.map_or(0.0, |t| t.beta),
                            v_two.map_or(0.0, |t| t.beta),
                            mask,
                            p.softcap.is_some(),
                            self.units,
                            k_two.is_some(),
                            v_two.is_some(),
                            kfmt.0,
                            kfmt.1,
                            kfmt.2,
                            vfmt.0,
                            vfmt.1,
                            vfmt.2,
                            ktable,
                            vtable,
                        );
                    }
                };
            }
            if l.f16 {
                launch!(half::f16);
            } else {
                launch!(f32);
            }
            // SAFETY: `states` as written above; `out` holds `q.rows · n_head · hd_v`; a
            // block-format V's offsets `n_kv_head · hd_v`.
            unsafe {
                at::attn_merge::launch(
                    &self.client,
                    CubeCount::Static(u(n * p.n_head), 1, 1),
                    CubeDim::new_1d(u(self.units)),
                    BufferArg::from_raw_parts(states.clone(), n * per_row),
                    BufferArg::from_raw_parts(self.exp_tab.clone(), 32),
                    BufferArg::from_raw_parts(v_center.clone(), 1),
                    BufferArg::from_raw_parts(self.turbo_tab.clone(), 1),
                    BufferArg::from_raw_parts(target.clone(), items * vdim),
                    BufferArg::from_raw_parts(
                        empty.clone(),
                        if v_two.is_some() { items } else { 1 },
                    ),
                    u(r0),
                    u(n_chunks),
                    u(p.n_head),
                    u(group),
                    u(vdim),
                    u(v_had),
                    v_hscale,
                    0,
                    self.units,
                    vfmt.0 > 0 && v_two.is_none(),
                    vfmt.2 == TURBO_TERM,
                    v_two.is_some(),
                );
            }
            r0 += n;
        }
        if v_two.is_some() {
            // SAFETY: `target` holds 128 values and `empty` one flag per (row, head); `out`
            // `items · 64` values; the offsets `n_kv_head · 64`.
            unsafe {
                kq::turbo_fold64::launch(
                    &self.client,
                    self.ew_count(items),
                    CubeDim::new_1d(self.ew),
                    BufferArg::from_raw_parts(target, items * vdim),
                    BufferArg::from_raw_parts(empty, items),
                    BufferArg::from_raw_parts(v_center, l.n_kv_head * l.hd_v),
                    BufferArg::from_raw_parts(self.turbo_tab.clone(), 1),
                    BufferArg::from_raw_parts(out.h.clone(), items * l.hd_v),
                    u(items),
                    u(p.n_head),
                    u(group),
                );
            }
        }
    }

    fn attention_seqs(
        &self,
        q: &CubeTensor,
        k: &CubeTensor,
        v: &CubeTensor,
        seqs: &mut [SeqAttention<'_, CubeKv, CubeIndex>],
        out: &mut CubeTensor,
    ) {
        // Each sequence's rows read and written in place, through views of the batch's
        // tensors: two launches' worth of work per sequence (the write, the attention), no
        // gathers or scatters.
        let total = q.rows;
        let mut width = None;
        for s in seqs.iter() {
            assert!(
                s.rows.start <= s.rows.end && s.rows.end <= total,
                "attention_seqs: rows {:?} of a {total}-row batch",
                s.rows
            );
            let l = &s.kv.layers[s.params.layer];
            let w = s.params.n_head * l.hd_v;
            assert!(
                *width.get_or_insert(w) == w,
                "attention_seqs: every sequence must have the same output width"
            );
        }
        self.resize(out, total, width.unwrap_or(0));
        for s in seqs.iter_mut() {
            if let Some(cells) = s.cells {
                assert_eq!(
                    (k.rows, v.rows),
                    (total, total),
                    "attention_seqs: K and V must have the batch's {total} rows"
                );
                self.kv_write(
                    s.kv,
                    s.params.layer,
                    cells,
                    &k.row_view(s.rows.clone()),
                    &v.row_view(s.rows.clone()),
                );
            }
            let mut o = out.row_view(s.rows.clone());
            // The view holds exactly the rows the attention writes, so it writes in place.
            self.attention(&q.row_view(s.rows.clone()), s.kv, &s.params, &mut o);
        }
    }
}

impl CubeTensor {
    /// Rows `rows` of this tensor as a tensor of their own, sharing its buffer (a handle
    /// offset, no copy): an op that writes it, within its size, writes these rows.
    fn row_view(&self, rows: std::ops::Range<usize>) -> CubeTensor {
        let start = rows.start * self.cols;
        let n = rows.len() * self.cols;
        CubeTensor {
            h: self
                .h
                .clone()
                .offset_start(u64::try_from(start * 4).expect("a buffer's size fits u64")),
            rows: rows.len(),
            cols: self.cols,
            cap: n,
        }
    }
}

impl CubeBackend {
    /// `out = x · wᵀ` into the `out.rows` rows of `out` (`[rows, w.n_out]`, sized by the
    /// caller): one output row per row of `x`, or a routed product (`route`, tile 1) whose
    /// output row `p` reads activation row `p / div` and the weight rows of its expert. The
    /// activations are quantized once, as they are, for an integer format.
    #[allow(
        clippy::too_many_lines,
        reason = "two formats' launches with one set of operands"
    )]
    fn launch_matmul(
        &self,
        x: &CubeTensor,
        w: &CubeWeight,
        route: Option<&Routed>,
        out: &CubeTensor,
    ) {
        let rows = out.rows;
        if rows == 0 || w.n_out == 0 {
            return;
        }
        let tile = match (route, rows) {
            (Some(_), _) | (None, 1) => 1,
            (None, 2) => 2,
            (None, 3 | 4) => 4,
            (None, _) => 8,
        };
        let count = CubeCount::Static(u(w.n_out), u(rows.div_ceil(tile)), 1);
        let dim = CubeDim::new_1d(u(self.units));
        let (ids, scales, stride, div) = match route {
            Some(r) => (
                r.ids.clone(),
                r.scales.clone().unwrap_or_else(|| self.unused.clone()),
                r.stride,
                r.div,
            ),
            None => (self.unused.clone(), self.unused.clone(), 0, 1),
        };
        let (by_id, scaled) = (route.is_some(), route.is_some_and(|r| r.scales.is_some()));
        let x_len = x.rows * w.n_in;
        match &w.data {
            WeightData::F32(h) => {
                // SAFETY: `x` is `[x.rows, n_in]` and every activation row read is below
                // `x.rows` (a routed product's `p / div`, checked by `matmul_id`); the rows
                // read of `h` are the view's (or its experts' views'), inside the upload;
                // `ids` holds one expert per output row and `scales` one value per expert
                // where read; `out` is `[rows, n_out]`.
                unsafe {
                    mm::matmul_f32::launch(
                        &self.client,
                        count,
                        dim,
                        BufferArg::from_raw_parts(x.h.clone(), x_len),
                        BufferArg::from_raw_parts(h.clone(), 1),
                        BufferArg::from_raw_parts(ids, 1),
                        BufferArg::from_raw_parts(scales, 1),
                        BufferArg::from_raw_parts(out.h.clone(), rows * w.n_out),
                        u(w.n_in),
                        u(w.n_out),
                        u(rows),
                        u(w.row0),
                        u(stride),
                        u(div),
                        0,
                        by_id,
                        scaled,
                        self.units,
                        tile,
                    );
                }
            }
            WeightData::Groups {
                fmt,
                codes,
                bd,
                bm,
                gsc,
                gmn,
            } => {
                let ablk = fmt.act.block();
                let n_blocks = x_len / ablk;
                let qa = self.client.empty(x_len * 4);
                let da = self.empty_f32(n_blocks);
                let sa = self.empty_f32(n_blocks);
                let kind = match fmt.act {
                    ActQuant::Q8_0 => 0,
                    ActQuant::Q8_1 => 1,
                    ActQuant::Q8K => 2,
                };
                // SAFETY: `x` holds `n_blocks` whole activation blocks (`n_in` is a multiple
                // of the format's block); the code and scale buffers hold `n_blocks` blocks.
                unsafe {
                    let qunits = self.units.min(ablk);
                    mm::quantize_act::launch(
                        &self.client,
                        CubeCount::Static(u(n_blocks), 1, 1),
                        CubeDim::new_1d(u(qunits)),
                        BufferArg::from_raw_parts(x.h.clone(), x_len),
                        BufferArg::from_raw_parts(qa.clone(), x_len),
                        BufferArg::from_raw_parts(da.clone(), n_blocks),
                        BufferArg::from_raw_parts(sa.clone(), n_blocks),
                        u(w.n_in),
                        0,
                        kind,
                        fmt.group,
                        qunits,
                    );
                }
                // SAFETY: the rows read of the weight's groups are the view's (or its
                // experts' views'), inside the upload; activation rows as for f32 weights;
                // `ids` and `scales` as there; `out` is `[rows, n_out]`.
                unsafe {
                    mm::matmul_blocks::launch(
                        &self.client,
                        count,
                        dim,
                        BufferArg::from_raw_parts(qa, x_len),
                        BufferArg::from_raw_parts(da, n_blocks),
                        BufferArg::from_raw_parts(sa, n_blocks),
                        BufferArg::from_raw_parts(codes.clone(), 1),
                        BufferArg::from_raw_parts(bd.clone(), 1),
                        BufferArg::from_raw_parts(bm.clone(), 1),
                        BufferArg::from_raw_parts(gsc.clone(), 1),
                        BufferArg::from_raw_parts(gmn.clone(), 1),
                        BufferArg::from_raw_parts(self.nl_tab.clone(), 32),
                        BufferArg::from_raw_parts(ids, 1),
                        BufferArg::from_raw_parts(scales, 1),
                        BufferArg::from_raw_parts(out.h.clone(), rows * w.n_out),
                        u(w.n_in),
                        u(w.n_out),
                        u(rows),
                        u(w.row0),
                        u(stride),
                        u(div),
                        0,
                        by_id,
                        scaled,
                        fmt.bits,
                        fmt.group,
                        fmt.block,
                        fmt.offset,
                        fmt.term.code(),
                        fmt.table.code(),
                        u(ablk),
                        self.units,
                        tile,
                        SEG_GROUPS / (fmt.block / fmt.group) as usize,
                    );
                }
            }
        }
    }

    /// Appends the first `bytes` bytes of `h` to `out`.
    fn read_prefix(&self, h: &Handle, bytes: usize, out: &mut Vec<u8>) {
        if bytes == 0 {
            return;
        }
        let all = self
            .client
            .read_one(h.clone())
            .unwrap_or_else(|e| panic!("{} backend: a kernel failed: {e:?}", self.name));
        out.extend_from_slice(&all[..bytes]);
    }

    /// Writes `bytes` (whole 32-bit words) over the start of `h`.
    fn write_prefix(&self, h: &Handle, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        if !bytes.len().is_multiple_of(4) {
            return Err(TensorError::Shape {
                op: "kv_import",
                detail: format!("a part of {} bytes, not whole 32-bit words", bytes.len()),
            });
        }
        let words = bytes.len() / 4;
        let src = self.client.create_from_slice(bytes);
        // SAFETY: `src` holds `words` words and the destination at least as many (the parts
        // are prefixes of its buffer).
        unsafe {
            rec::copy_u32::launch(
                &self.client,
                self.ew_count(words),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(src, words),
                BufferArg::from_raw_parts(h.clone(), words),
                u(words),
            );
        }
        Ok(())
    }

    /// `dst[dst0..dst0 + n] = src[src0..src0 + n]` (f32 values).
    fn copy(&self, src: &Handle, src0: usize, dst: &Handle, dst0: usize, n: usize) {
        if n == 0 {
            return;
        }
        // SAFETY: the callers pass ranges inside both buffers.
        unsafe {
            rec::copy_f32::launch(
                &self.client,
                self.ew_count(n),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(src.clone(), src0 + n),
                BufferArg::from_raw_parts(dst.clone(), dst0 + n),
                u(src0),
                u(dst0),
                u(n),
            );
        }
    }

    /// Sets a quantized plane's per-head offsets to the column means of `src`, the first rows
    /// the layer writes (`Plane::calibrate` of the CPU backend's cache), once.
    fn calibrate(&self, calibrated: &mut bool, center: &Handle, src: &CubeTensor) {
        if *calibrated {
            return;
        }
        // SAFETY: `src` holds `rows · cols` values, `center` `cols`.
        unsafe {
            kq::kv_center::launch(
                &self.client,
                self.ew_count(src.cols),
                CubeDim::new_1d(self.ew),
                BufferArg::from_raw_parts(src.h.clone(), src.rows * src.cols),
                BufferArg::from_raw_parts(center.clone(), src.cols),
                u(src.rows),
                u(src.cols),
            );
        }
        *calibrated = true;
    }

    /// RMS norm of `groups` consecutive runs of `group` values.
    fn norm(
        &self,
        x: &Handle,
        w: Option<Handle>,
        out: &Handle,
        groups: usize,
        group: usize,
        eps: f32,
    ) {
        if groups == 0 {
            return;
        }
        let has_w = w.is_some();
        let wh = w.unwrap_or_else(|| self.client.empty(4));
        // SAFETY: `x` and `out` hold `groups · group` values, `w` `group` when present.
        unsafe {
            ew::rms_norm::launch(
                &self.client,
                CubeCount::Static(u(groups), 1, 1),
                CubeDim::new_1d(u(self.units)),
                BufferArg::from_raw_parts(x.clone(), groups * group),
                BufferArg::from_raw_parts(wh, group),
                BufferArg::from_raw_parts(out.clone(), groups * group),
                u(group),
                eps,
                has_w,
                self.units,
            );
        }
    }
}
