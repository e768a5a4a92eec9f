//! The per-tile kernels of [`crate::matmul`]: one weight type against its activation type.
//!
//! A tile is a block of weight rows and a block of activation rows. Every output of the tile
//! is the dot product of one weight row and one activation row with the semantics of the
//! single-row kernels of [`specula_quant::dot`] — and the same bits. Where this CPU has
//! micro-kernels for the format (`avx512`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), groups
//! of four activation rows go through 2 × 4 and 1 × 4 kernels (weight rows × activation rows:
//! the weight row is unpacked once for four activation rows) and single activation rows
//! through 8 × 1 and 4 × 1 kernels; each micro-kernel reduces every output exactly as the
//! single-row kernel does, and what is left over uses the single-row kernel itself. Which path
//! an output takes depends on the tile shape, never on its value; `tests/matmul.rs` checks the
//! bits against the single-row and the scalar kernels.
//!
//! Other formats (Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS, MXFP4, NVFP4, f32, f16, bf16) and other
//! instruction sets (AVX2 without AVX-512, NEON) use the single-row kernels for every output;
//! micro-kernels for them are the next step.

use bytemuck::cast_slice as c;
use specula_quant::QType;
use specula_quant::dot::{Kernels, SimdLevel};

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod lanes;

/// A dot product of one weight row and one activation row, as bytes.
type RowDot = fn(&Kernels, &[u8], &[u8]) -> f32;

/// A micro-kernel: `MR` weight rows against `NR` activation rows (byte rows), up to eight
/// outputs in weight-row-major order.
type MicroFn<const MR: usize, const NR: usize> = unsafe fn(Rows<'_, MR>, [&[u8]; NR]) -> [f32; 8];

/// The weight rows of one micro-kernel call.
#[derive(Clone, Copy)]
pub(crate) enum Rows<'a, const MR: usize> {
    /// Rows as they lie in the file, one byte slice each.
    Plain([&'a [u8]; MR]),
    /// Rows `k0..k0 + MR` of a packed group of `r` rows (the bytes of the whole group), see
    /// [`Packing`].
    Packed {
        /// The group's bytes.
        group: &'a [u8],
        /// Rows in the group.
        r: usize,
        /// The first of the kernel's rows in the group.
        k0: usize,
    },
}

/// How the matmul of a weight type wants its rows laid out in memory, in groups of `r`
/// consecutive rows (rows after the last whole group stay as they are):
///
/// - *blocks* (K-quants): block-interleaved — block 0 of each of the `r` rows, then block 1 of
///   each, … — the order in which a row-major micro-kernel over the group reads them. As laid
///   out in the file, the `r` rows a decode micro-kernel reads at once are `r` short
///   interleaved streams that the hardware prefetchers follow badly (a Q8_0 GEMV over
///   896-value rows streamed 6.6 GB/s from DRAM on one thread); packed, they are one stream.
/// - *lanes* (32-value formats): one row per 32-bit vector lane, see `lanes`; also read in
///   memory order, and no reduction across lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Packing {
    /// Rows per group.
    pub(crate) r: usize,
    /// The lane layout's format, `None` for the block layout.
    #[cfg(target_arch = "x86_64")]
    lanes: Option<lanes::Fmt>,
}

impl Packing {
    /// Rearranges the plain rows `src` (`rb` bytes each, blocks of `bs` bytes) into `dst` in
    /// this packing. `src` and `dst` have the same length.
    ///
    /// # Panics
    /// If the lengths differ or are not whole rows of whole blocks.
    pub(crate) fn pack(self, src: &[u8], dst: &mut [u8], rb: usize, bs: usize) {
        assert!(
            src.len() == dst.len()
                && rb > 0
                && src.len().is_multiple_of(rb)
                && rb.is_multiple_of(bs),
            "packing: {} bytes into {} in rows of {rb}, blocks of {bs}",
            src.len(),
            dst.len()
        );
        let group = self.r * rb;
        let full = src.len() / group * group;
        for (s, d) in src[..full]
            .chunks_exact(group)
            .zip(dst[..full].chunks_exact_mut(group))
        {
            #[cfg(target_arch = "x86_64")]
            if let Some(fmt) = self.lanes {
                match fmt {
                    lanes::Fmt::Q4K => lanes::pack_group_q4k(s, d, rb),
                    lanes::Fmt::Q6K => lanes::pack_group_q6k(s, d, rb),
                    _ => lanes::pack_group(fmt, s, d, rb),
                }
                continue;
            }
            for (b, d) in d.chunks_exact_mut(self.r * bs).enumerate() {
                for (k, d) in d.chunks_exact_mut(bs).enumerate() {
                    let at = k * rb + b * bs;
                    d.copy_from_slice(&s[at..at + bs]);
                }
            }
        }
        dst[full..].copy_from_slice(&src[full..]);
    }

    /// Whether the lane kernels need the activation blocks' value sums (see
    /// `lanes::block_sums`).
    pub(crate) fn needs_sums(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Some(f) = self.lanes {
            return f.needs_sums();
        }
        false
    }
}

/// The micro-kernels of one format: `MR` weight rows against `NR` activation rows at once,
/// outputs in weight-row-major order (see `avx512`).
#[derive(Clone, Copy)]
struct Micro {
    /// Absent for formats where eight rows at once do not pay (register pressure).
    w8: Option<MicroFn<8, 1>>,
    w4: MicroFn<4, 1>,
    a4: MicroFn<1, 4>,
    a4x2: MicroFn<2, 4>,
}

/// The kernels of one weight type.
#[derive(Clone, Copy)]
pub(crate) struct Gemm {
    ty: QType,
    kernels: &'static Kernels,
    dot: RowDot,
    /// Only set when this CPU has the micro-kernels' instruction set (see [`Gemm::new`]).
    micro: Option<Micro>,
}

/// The packing the matmul of `ty` uses with `kernels`, if any (see [`Packing`]).
pub(crate) fn packing(kernels: &Kernels, ty: QType) -> Option<Packing> {
    let m = micro(kernels.level(), ty)?;
    #[cfg(target_arch = "x86_64")]
    if let Some(fmt) = lanes::Fmt::of(ty) {
        return Some(Packing {
            r: lanes::ROWS,
            lanes: Some(fmt),
        });
    }
    Some(Packing {
        r: if m.w8.is_some() { 8 } else { 4 },
        #[cfg(target_arch = "x86_64")]
        lanes: None,
    })
}

impl Gemm {
    /// The kernels for weights of `ty` from the table `kernels`.
    ///
    /// # Panics
    /// If `ty` has no dot product (activation-only and KV-only types; weights of those types
    /// are refused at load).
    pub(crate) fn new(kernels: &'static Kernels, ty: QType) -> Self {
        let dot: RowDot = match ty {
            QType::Q4_0 => |k, w, a| k.q4_0_q8_0(c(w), c(a)),
            QType::Q4_1 => |k, w, a| k.q4_1_q8_1(c(w), c(a)),
            QType::Q5_0 => |k, w, a| k.q5_0_q8_0(c(w), c(a)),
            QType::Q5_1 => |k, w, a| k.q5_1_q8_1(c(w), c(a)),
            QType::Q8_0 => |k, w, a| k.q8_0_q8_0(c(w), c(a)),
            QType::IQ4_NL => |k, w, a| k.iq4_nl_q8_0(c(w), c(a)),
            QType::MXFP4 => |k, w, a| k.mxfp4_q8_0(c(w), c(a)),
            QType::NVFP4 => |k, w, a| k.nvfp4_q8_0(c(w), c(a)),
            QType::Q2_K => |k, w, a| k.q2_k_q8_k(c(w), c(a)),
            QType::Q3_K => |k, w, a| k.q3_k_q8_k(c(w), c(a)),
            QType::Q4_K => |k, w, a| k.q4_k_q8_k(c(w), c(a)),
            QType::Q5_K => |k, w, a| k.q5_k_q8_k(c(w), c(a)),
            QType::Q6_K => |k, w, a| k.q6_k_q8_k(c(w), c(a)),
            QType::IQ4_XS => |k, w, a| k.iq4_xs_q8_k(c(w), c(a)),
            QType::F32 => |k, w, a| k.f32_f32(c(w), c(a)),
            QType::F16 => |k, w, a| k.f16_f32(c(w), c(a)),
            QType::BF16 => |k, w, a| k.bf16_f32(c(w), c(a)),
            QType::Q8_1 | QType::Q8_K | QType::Turbo2 | QType::Turbo3 | QType::Turbo4 => {
                panic!("matmul: {ty} is not a weight format")
            }
        };
        Self {
            ty,
            kernels,
            dot,
            micro: micro(kernels.level(), ty),
        }
    }

    /// The dot product of one weight row and one activation row.
    #[inline]
    pub(crate) fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        (self.dot)(self.kernels, w, a)
    }

    /// Every output of a tile: the dot product of each weight row of `w` (`w_rb` bytes each)
    /// with each activation row of `a` (`a_rb` bytes each), handed to `put(a_row, w_row, v)`.
    /// With `packed = Some((p, n))` the first `n` weight rows of the tile (whole groups,
    /// starting at a group boundary) are laid out in packing `p`, which must be this format's
    /// [`packing`]; the rest are plain.
    ///
    /// # Panics
    /// If the weight rows and the activation rows do not hold the same number of values in
    /// whole blocks of their types, or the packed rows are not whole groups.
    #[allow(
        clippy::too_many_arguments,
        reason = "the tile's two operands with their row sizes, the weights' layout, the activations' block sums and the output"
    )]
    pub(crate) fn tile(
        &self,
        w: &[u8],
        w_rb: usize,
        packed: Option<(Packing, usize)>,
        a: &[u8],
        a_rb: usize,
        sums: &[u8],
        mut put: impl FnMut(usize, usize, f32),
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some((
            p @ Packing {
                lanes: Some(fmt), ..
            },
            n,
        )) = packed
        {
            assert!(
                self.micro.is_some() && n.is_multiple_of(p.r) && n * w_rb <= w.len(),
                "matmul: {n} lane-packed rows do not fit the tile"
            );
            let n_a = a.len() / a_rb;
            let nb = w_rb / self.ty.type_size();
            let s_rb = if fmt.needs_sums() { 4 * nb } else { 0 };
            assert!(
                sums.len() >= n_a * s_rb,
                "matmul: missing activation block sums"
            );
            let ar = |j: usize| &a[j * a_rb..(j + 1) * a_rb];
            let sr = |j: usize| &sums[j * s_rb..(j + 1) * s_rb];
            for g0 in (0..n).step_by(p.r) {
                let group = &w[g0 * w_rb..(g0 + p.r) * w_rb];
                let mut j = 0;
                while j + 4 <= n_a {
                    // SAFETY: lane packings are only made when this CPU runs the
                    // micro-kernels' instruction set (`packing`), which is the lane kernels'.
                    let v = unsafe {
                        lanes::run::<4>(
                            fmt,
                            group,
                            nb,
                            [ar(j), ar(j + 1), ar(j + 2), ar(j + 3)],
                            [sr(j), sr(j + 1), sr(j + 2), sr(j + 3)],
                        )
                    };
                    for (dj, v) in v.iter().enumerate() {
                        for (k, &v) in v.iter().enumerate() {
                            put(j + dj, g0 + k, v);
                        }
                    }
                    j += 4;
                }
                // The last one to three rows in one pass (a pass per row would re-run the
                // group's codes for each).
                macro_rules! rest {
                    ($($d:literal),+) => {{
                        // SAFETY: as above.
                        let v = unsafe {
                            lanes::run::<{ [$($d),+].len() }>(
                                fmt,
                                group,
                                nb,
                                [$(ar(j + $d)),+],
                                [$(sr(j + $d)),+],
                            )
                        };
                        for (dj, v) in v.iter().enumerate() {
                            for (k, &v) in v.iter().enumerate() {
                                put(j + dj, g0 + k, v);
                            }
                        }
                    }};
                }
                match n_a - j {
                    3 => rest!(0, 1, 2),
                    2 => rest!(0, 1),
                    1 => rest!(0),
                    _ => {}
                }
            }
            // The rows after the last whole group are plain.
            self.tile_rows(&w[n * w_rb..], w_rb, None, a, a_rb, n, &mut put);
            return;
        }
        let _ = sums;
        self.tile_rows(w, w_rb, packed, a, a_rb, 0, &mut put);
    }

    /// [`Gemm::tile`] for plain rows and rows packed in blocks, handing weight row `i` of
    /// `w` to `put` as row `off + i`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the tile's two operands with their row sizes, its layout and its output"
    )]
    fn tile_rows(
        &self,
        w: &[u8],
        w_rb: usize,
        packed: Option<(Packing, usize)>,
        a: &[u8],
        a_rb: usize,
        off: usize,
        put: &mut impl FnMut(usize, usize, f32),
    ) {
        let mut put = |j: usize, i: usize, v: f32| put(j, off + i, v);
        let values = |ty: QType, rb: usize| {
            assert!(
                rb > 0 && rb.is_multiple_of(ty.type_size()),
                "{ty}: rows of {rb} bytes are not whole blocks"
            );
            rb / ty.type_size() * ty.block_size()
        };
        let n_in = values(self.ty, w_rb);
        assert_eq!(
            n_in,
            values(self.ty.vec_dot_type(), a_rb),
            "matmul: weight and activation rows differ in length"
        );
        let (n_w, n_a) = (w.len() / w_rb, a.len() / a_rb);
        let (r, n_packed) = match packed {
            Some((p, n)) => {
                let m = self.micro.expect("packed weights come with micro-kernels");
                assert!(
                    n <= n_w && n.is_multiple_of(p.r) && (p.r == 8) == m.w8.is_some(),
                    "matmul: {n} packed rows in groups of {} do not fit the tile",
                    p.r
                );
                (p.r, n)
            }
            None => (1, 0),
        };
        let wr = |i: usize| &w[i * w_rb..(i + 1) * w_rb];
        let ar = |j: usize| &a[j * a_rb..(j + 1) * a_rb];
        // `M` weight rows from row `i` for a micro-kernel: packed inside a packed group (the
        // kernels never straddle a group: groups are aligned and the row counts divide them),
        // plain after.
        macro_rules! sel {
            ($i:expr, $m:literal) => {{
                let i = $i;
                if i < n_packed {
                    let g0 = i / r * r;
                    Rows::Packed {
                        group: &w[g0 * w_rb..(g0 + r) * w_rb],
                        r,
                        k0: i - g0,
                    }
                } else {
                    Rows::Plain(std::array::from_fn::<_, $m, _>(|k| wr(i + k)))
                }
            }};
        }
        // SAFETY (every micro-kernel call below): `micro` is only set after this CPU's features
        // were detected (`micro()`), and every row is whole blocks with weight and activation
        // rows holding the same number of values (both checked above).
        let mut j = 0;
        if let Some(m) = self.micro {
            // Groups of four activation rows: two weight rows at a time, then one.
            while j + 4 <= n_a {
                let a4 = [ar(j), ar(j + 1), ar(j + 2), ar(j + 3)];
                let mut i = 0;
                while i + 2 <= n_w {
                    // SAFETY: see above.
                    let v = unsafe { (m.a4x2)(sel!(i, 2), a4) };
                    for (p, &v) in v.iter().enumerate() {
                        put(j + p % 4, i + p / 4, v);
                    }
                    i += 2;
                }
                if i < n_w {
                    // SAFETY: see above.
                    let v = unsafe { (m.a4)(sel!(i, 1), a4) };
                    for (p, &v) in v[..4].iter().enumerate() {
                        put(j + p, i, v);
                    }
                }
                j += 4;
            }
        }
        for j in j..n_a {
            let a_row = ar(j);
            let mut i = 0;
            if let Some(m) = self.micro {
                while let Some(w8) = m.w8.filter(|_| i + 8 <= n_w) {
                    // SAFETY: see above.
                    let v = unsafe { w8(sel!(i, 8), [a_row]) };
                    for (k, &v) in v.iter().enumerate() {
                        put(j, i + k, v);
                    }
                    i += 8;
                }
                while i + 4 <= n_w {
                    // SAFETY: see above.
                    let v = unsafe { (m.w4)(sel!(i, 4), [a_row]) };
                    for (k, &v) in v[..4].iter().enumerate() {
                        put(j, i + k, v);
                    }
                    i += 4;
                }
            }
            debug_assert!(i >= n_packed, "packed rows are whole micro-kernel groups");
            for i in i..n_w {
                put(j, i, self.dot(wr(i), a_row));
            }
        }
    }
}

/// The micro-kernels for weights of `ty` at `level`, if there are any and this CPU runs them.
fn micro(level: SimdLevel, ty: QType) -> Option<Micro> {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 && avx512::supported() {
        macro_rules! set {
            ($k:ident) => {
                set!($k, Some(avx512::$k::run::<8, 1>))
            };
            ($k:ident, $w8:expr) => {
                Some(Micro {
                    w8: $w8,
                    w4: avx512::$k::run::<4, 1>,
                    a4: avx512::$k::run::<1, 4>,
                    a4x2: avx512::$k::run::<2, 4>,
                })
            };
        }
        return match ty {
            QType::Q4_0 => set!(q4_0),
            // Q4_1 / Q5_1 carry four scale fields per pair of blocks: eight weight rows at once
            // spill registers and measure slower than four.
            QType::Q4_1 => set!(q4_1, None),
            QType::Q5_0 => set!(q5_0),
            QType::Q5_1 => set!(q5_1, None),
            QType::Q8_0 => set!(q8_0),
            QType::Q4_K => set!(q4_k),
            QType::Q6_K => set!(q6_k),
            _ => None,
        };
    }
    let _ = (level, ty);
    None
}
