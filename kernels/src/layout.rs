//! Weights on the device: every integer block format unpacked, once at upload, into one
//! layout the kernels share.
//!
//! A GGUF block format stores, per block, one or two f16 scales and bit-packed codes, in a
//! byte layout of its own (a 34-byte `block_q8_0`, a 144-byte `block_q4_K` with 6-bit
//! sub-block scales). On the device every such format becomes
//!
//! - codes of `bits` bits each, in groups of `group` values (32, or 16 for Q2_K, Q3_K and
//!   Q6_K), packed little-endian into u32 words (`group · bits / 32` words per group), read
//!   unsigned with the format's `offset` subtracted (Q3_K's 3-bit codes take 4 bits: sixteen
//!   of 3 bits would not fill whole words);
//! - per block (`block` values: 32, or 256 for the K-quants and IQ4_XS) its f16 scales as f32:
//!   `d`, and `m` (Q4_1, Q5_1) or `dmin` (Q2_K, Q4_K, Q5_K);
//! - per group of a K-quant (and IQ4_XS) its integer sub-block scale (and min): Q3_K's and
//!   IQ4_XS's 6-bit scales less 32, as ggml subtracts it;
//! - for the codebook formats (IQ4_NL, IQ4_XS, MXFP4, NVFP4) the 4-bit codes, which the kernels map
//!   through the format's table of integers ([`Table`]) so the products stay integer, and per
//!   block its scale as f32 (IQ4_NL's f16 `d`; MXFP4's E8M0 exponent and NVFP4's UE4M3 scale
//!   per 16 values, each decoded to half its value as ggml does).
//!
//! The integers stay integers, so the matmul kernels form exactly the integer sums of
//! specula-quant's dot products and combine them with the same float operations in the same
//! order: the device's products have the CPU backend's bits. One kernel, specialised at
//! compile time by [`GroupFormat`], serves every format: the combinations are generated, not
//! hand-copied. The price is a few bytes per block (f32 scales instead of f16, i32 sub-block
//! scales instead of 6 bits): Q4_0 reads 5 bits per weight instead of 4.5, Q4_K 5.25 instead
//! of 4.5 (`docs/perf.md`).

use specula_quant::QType;

/// The activation quantization a weight format's dot product takes (ggml's `vec_dot_type`):
/// the CPU backend quantizes activations before its integer dot products, and the device does
/// the same so both compute the same products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActQuant {
    /// 32-value blocks, `d = amax / 127` stored as f16, codes `round(x / d)`.
    Q8_0,
    /// As `Q8_0`, with `s = d · Σ q` stored as f16 (for formats with a min).
    Q8_1,
    /// 256-value blocks, `d = max / −127` (f32), codes `nearest_int(x / d)` (the K-quants).
    Q8K,
}

impl ActQuant {
    /// Values per activation block.
    #[must_use]
    pub fn block(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q8_1 => 32,
            Self::Q8K => 256,
        }
    }
}

/// How a block's float term is formed from its integer sums (specula-quant's `*_term`
/// functions, one per formula).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Term {
    /// `(isum · d_w) · d_a` (Q4_0).
    Q4_0,
    /// `isum · (d_w · d_a)` (Q8_0).
    Q8_0,
    /// `(d_w · d_a) · isum` (Q5_0, Q3_K, Q6_K, IQ4_XS).
    Dd,
    /// `(d_w · d_a) · isum + m_w · s_a` (Q4_1, Q5_1).
    Min,
    /// `(d_w · d_a) · isum − (dmin_w · d_a) · summs` (Q2_K, Q4_K, Q5_K).
    KMin,
}

impl Term {
    /// The kernels' compile-time code of the term.
    #[must_use]
    pub fn code(self) -> u32 {
        match self {
            Self::Q4_0 => 0,
            Self::Q8_0 => 1,
            Self::Dd => 2,
            Self::Min => 3,
            Self::KMin => 4,
        }
    }
}

/// How a format's blocks read: the compile-time parameters of the matmul and row kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupFormat {
    /// Bits per code.
    pub bits: u32,
    /// Values per group (32, or 16 for Q2_K, Q3_K, Q6_K): one integer scale each in a
    /// K-quant.
    pub group: u32,
    /// Values per block (32, or 256 for the K-quants and IQ4_XS): one float term each.
    pub block: u32,
    /// Subtracted from each code (8 for Q4_0, 4 for Q3_K's codes with the high bit set when
    /// ggml's is clear, 128 for Q8_0's signed bytes stored biased).
    pub offset: u32,
    /// The block term.
    pub term: Term,
    /// Activation quantization of the dot product (its blocks are `act.block()` values: a
    /// weight block of NVFP4's 16 values reads half of one).
    pub act: ActQuant,
    /// How a code becomes its integer: [`Table::None`] (`code − offset`) or a codebook.
    pub table: Table,
}

/// The codebook of a format whose codes index a table of integers: the integer sums of the
/// dot products stay exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Table {
    /// The code less the format's offset.
    None,
    /// IQ4_NL's non-linear values (`kvalues_iq4nl`; IQ4_NL, IQ4_XS).
    Iq4Nl,
    /// FP4 (E2M1) values, doubled (`kvalues_mxfp4`; MXFP4, NVFP4).
    Fp4,
}

impl Table {
    /// The kernels' compile-time code: 0 none, else `1 +` the table's index in
    /// [`Table::all`].
    #[must_use]
    pub fn code(self) -> u32 {
        match self {
            Self::None => 0,
            Self::Iq4Nl => 1,
            Self::Fp4 => 2,
        }
    }

    /// The codebooks one after the other (sixteen values each), as the device holds them.
    #[must_use]
    pub fn all() -> Vec<i32> {
        specula_quant::iq4::KVALUES_IQ4NL
            .iter()
            .chain(&specula_quant::fp4::KVALUES_FP4)
            .map(|&v| i32::from(v))
            .collect()
    }

    fn value(self, code: u32) -> i32 {
        let i = code as usize;
        match self {
            Self::None => unreachable!("a format without a codebook"),
            Self::Iq4Nl => i32::from(specula_quant::iq4::KVALUES_IQ4NL[i]),
            Self::Fp4 => i32::from(specula_quant::fp4::KVALUES_FP4[i]),
        }
    }
}

impl GroupFormat {
    /// The layout of `ty`, or `None` for a format the device keeps as floats (f32, f16,
    /// bf16) or does not support yet.
    #[must_use]
    pub fn of(ty: QType) -> Option<Self> {
        let f = |bits, group, block, offset, term, act| Self {
            bits,
            group,
            block,
            offset,
            term,
            act,
            table: Table::None,
        };
        let nl = |group, table| Self {
            table,
            ..f(4, group, group, 0, Term::Dd, ActQuant::Q8_0)
        };
        Some(match ty {
            QType::IQ4_NL => nl(32, Table::Iq4Nl),
            QType::MXFP4 => nl(32, Table::Fp4),
            // One float term per 16-value sub-block (its UE4M3 scale).
            QType::NVFP4 => nl(16, Table::Fp4),
            QType::Q8_0 => f(8, 32, 32, 128, Term::Q8_0, ActQuant::Q8_0),
            QType::Q4_0 => f(4, 32, 32, 8, Term::Q4_0, ActQuant::Q8_0),
            QType::Q5_0 => f(5, 32, 32, 16, Term::Dd, ActQuant::Q8_0),
            QType::Q4_1 => f(4, 32, 32, 0, Term::Min, ActQuant::Q8_1),
            QType::Q5_1 => f(5, 32, 32, 0, Term::Min, ActQuant::Q8_1),
            QType::Q4_K => f(4, 32, 256, 0, Term::KMin, ActQuant::Q8K),
            QType::Q5_K => f(5, 32, 256, 0, Term::KMin, ActQuant::Q8K),
            QType::Q6_K => f(6, 16, 256, 32, Term::Dd, ActQuant::Q8K),
            QType::Q2_K => f(2, 16, 256, 0, Term::KMin, ActQuant::Q8K),
            QType::Q3_K => f(4, 16, 256, 4, Term::Dd, ActQuant::Q8K),
            QType::IQ4_XS => Self {
                table: Table::Iq4Nl,
                ..f(4, 32, 256, 0, Term::Dd, ActQuant::Q8K)
            },
            _ => return None,
        })
    }

    /// u32 words of codes per group.
    #[must_use]
    pub fn words(self) -> usize {
        (self.group * self.bits / 32) as usize
    }

    /// Whether groups carry integer scales (the K-quants, IQ4_XS).
    #[must_use]
    pub fn group_scales(self) -> bool {
        self.block > self.group
    }

    /// Whether blocks carry a second float (`m` or `dmin`).
    #[must_use]
    pub fn block_min(self) -> bool {
        matches!(self.term, Term::Min | Term::KMin)
    }
}

/// One weight matrix in the device layout, on the host (before upload).
#[derive(Clone, Debug, Default)]
pub struct Groups {
    /// Per block, `d`.
    pub d: Vec<f32>,
    /// Per block, `m` or `dmin` (empty for formats without).
    pub m: Vec<f32>,
    /// Per group of a K-quant, its integer scale (empty otherwise).
    pub sc: Vec<i32>,
    /// Per group of Q2_K / Q4_K / Q5_K, its integer min (empty otherwise).
    pub mn: Vec<i32>,
    /// Codes, [`GroupFormat::words`] per group.
    pub codes: Vec<u32>,
}

fn half(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Unpacks every block of `bytes` (whole blocks of `ty`) into the device layout.
///
/// # Panics
/// If `ty` has no device layout ([`GroupFormat::of`]) or `bytes` is not whole blocks; the
/// backend checks both before calling.
#[must_use]
pub fn unpack(ty: QType, bytes: &[u8]) -> Groups {
    let fmt = GroupFormat::of(ty).expect("a format with a device layout");
    let bs = ty.type_size();
    assert_eq!(bytes.len() % bs, 0, "whole blocks");
    let mut g = Groups::default();
    let mut codes = [0u8; 256];
    for b in bytes.chunks_exact(bs) {
        match ty {
            QType::Q8_0 => {
                g.d.push(half(b, 0));
                for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
                    *c = q ^ 0x80; // two's complement byte + 128
                }
            }
            QType::IQ4_NL | QType::MXFP4 => {
                let (d, qs) = if ty == QType::IQ4_NL {
                    (half(b, 0), &b[2..18])
                } else {
                    (specula_quant::fp4::e8m0_to_fp32_half(b[0]), &b[1..17])
                };
                g.d.push(d);
                for (j, &q) in qs.iter().enumerate() {
                    codes[j] = q & 0xF;
                    codes[j + 16] = q >> 4;
                }
            }
            QType::NVFP4 => {
                // Four sub-blocks of 16: scale byte `s`, then eight bytes holding values
                // `j` (low nibble) and `j + 8` (high nibble).
                for s in 0..4 {
                    g.d.push(specula_quant::fp4::ue4m3_to_fp32_half(b[s]));
                    for (j, &q) in b[4 + 8 * s..12 + 8 * s].iter().enumerate() {
                        codes[16 * s + j] = q & 0xF;
                        codes[16 * s + j + 8] = q >> 4;
                    }
                }
            }
            QType::Q4_0 | QType::Q4_1 => {
                let qs = if ty == QType::Q4_0 {
                    g.d.push(half(b, 0));
                    &b[2..18]
                } else {
                    g.d.push(half(b, 0));
                    g.m.push(half(b, 2));
                    &b[4..20]
                };
                for (j, &q) in qs.iter().enumerate() {
                    codes[j] = q & 0xF;
                    codes[j + 16] = q >> 4;
                }
            }
            QType::Q5_0 | QType::Q5_1 => {
                let (qh, qs) = if ty == QType::Q5_0 {
                    g.d.push(half(b, 0));
                    (&b[2..6], &b[6..22])
                } else {
                    g.d.push(half(b, 0));
                    g.m.push(half(b, 2));
                    (&b[4..8], &b[8..24])
                };
                let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
                for (j, &q) in qs.iter().enumerate() {
                    let hi = |bit: usize| u8::from((qh >> bit) & 1 == 1) << 4;
                    codes[j] = (q & 0xF) | hi(j);
                    codes[j + 16] = (q >> 4) | hi(j + 16);
                }
            }
            QType::Q4_K | QType::Q5_K => {
                g.d.push(half(b, 0));
                g.m.push(half(b, 2));
                let sc: &[u8; 12] = b[4..16].try_into().expect("12 scale bytes");
                let (qh, qs) = if ty == QType::Q4_K {
                    (None, &b[16..144])
                } else {
                    (Some(&b[16..48]), &b[48..176])
                };
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, sc);
                    g.sc.push(i32::from(s));
                    g.mn.push(i32::from(m));
                }
                for c in 0..4 {
                    for l in 0..32 {
                        let q = qs[32 * c + l];
                        let (mut lo, mut hi) = (q & 0xF, q >> 4);
                        if let Some(qh) = qh {
                            lo |= u8::from(qh[l] & (1 << (2 * c)) != 0) << 4;
                            hi |= u8::from(qh[l] & (2 << (2 * c)) != 0) << 4;
                        }
                        codes[64 * c + l] = lo;
                        codes[64 * c + 32 + l] = hi;
                    }
                }
            }
            QType::Q6_K => {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                g.d.push(half(b, 208));
                g.sc.extend(sc.iter().map(|&s| i32::from(s.cast_signed())));
                for n in 0..2 {
                    let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                    let y = &mut codes[128 * n..];
                    for l in 0..32 {
                        y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                        y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                        y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    }
                }
            }
            QType::Q2_K => {
                // scales[16] (4-bit scale, 4-bit min per 16 values), qs[64], d, dmin: element
                // 128h + 32j + l is bits 2j..2j+2 of qs[32h + l].
                let (sc, qs) = (&b[0..16], &b[16..80]);
                g.d.push(half(b, 80));
                g.m.push(half(b, 82));
                g.sc.extend(sc.iter().map(|&s| i32::from(s & 0xF)));
                g.mn.extend(sc.iter().map(|&s| i32::from(s >> 4)));
                for h in 0..2 {
                    for j in 0..4 {
                        for l in 0..32 {
                            codes[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
                        }
                    }
                }
            }
            QType::Q3_K => {
                // hmask[32], qs[64], scales[12] (6-bit, less 32), d: element 128h + 32j + l
                // is bits 2j..2j+2 of qs[32h + l], less 4 when bit 4h + j of hmask[l] is
                // clear — stored as the code with that bit as its third, less 4.
                let (hm, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
                g.d.push(half(b, 108));
                for j in 0..16 {
                    let lo = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 };
                    let hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
                    g.sc.push(i32::from(lo | (hi << 4)) - 32);
                }
                for h in 0..2 {
                    for j in 0..4 {
                        for l in 0..32 {
                            let lo = (qs[32 * h + l] >> (2 * j)) & 3;
                            let hi = u8::from(hm[l] & (1 << (4 * h + j)) != 0) << 2;
                            codes[128 * h + 32 * j + l] = lo | hi;
                        }
                    }
                }
            }
            QType::IQ4_XS => {
                // d, scales_h (u16), scales_l[4], qs[128]: sub-block j's scale is nibble j of
                // scales_l with bits 2j..2j+2 of scales_h above it, less 32; its 32 values
                // are the low then the high nibbles of qs[16j..16j + 16].
                g.d.push(half(b, 0));
                let sh = u16::from_le_bytes([b[2], b[3]]);
                let (sl, qs) = (&b[4..8], &b[8..136]);
                for j in 0..8 {
                    let lo = (sl[j / 2] >> (4 * (j % 2))) & 0xF;
                    let hi = (sh >> (2 * j)) & 3;
                    g.sc.push(i32::from(u16::from(lo) | (hi << 4)) - 32);
                    for (l, &q) in qs[16 * j..16 * j + 16].iter().enumerate() {
                        codes[32 * j + l] = q & 0xF;
                        codes[32 * j + l + 16] = q >> 4;
                    }
                }
            }
            _ => unreachable!("GroupFormat::of covers the formats unpacked here"),
        }
        let group = fmt.group as usize;
        for c in codes[..ty.block_size()].chunks_exact(group) {
            pack(c, fmt.bits, &mut g.codes);
        }
    }
    g
}

/// `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Appends `codes` (each below `2^bits`) packed little-endian at `bits` bits each; a whole
/// group fills whole words.
fn pack(codes: &[u8], bits: u32, out: &mut Vec<u32>) {
    let start = out.len();
    out.resize(start + codes.len() * bits as usize / 32, 0);
    let words = &mut out[start..];
    for (i, &c) in codes.iter().enumerate() {
        let at = i * bits as usize;
        let (w, sh) = (at / 32, u32::try_from(at % 32).expect("below 32"));
        words[w] |= u32::from(c) << sh;
        if sh + bits > 32 {
            words[w + 1] |= u32::from(c) >> (32 - sh);
        }
    }
}

/// Value `i` of the row data (counting from its first block), as the kernels read it: the
/// host mirror of the device's dequantizer, ggml's formula for each format.
#[must_use]
pub fn value(fmt: GroupFormat, g: &Groups, i: usize) -> f32 {
    let (group, block) = (fmt.group as usize, fmt.block as usize);
    let (gi, bi) = (i / group, i / block);
    let at = (i % group) * fmt.bits as usize;
    let words = &g.codes[gi * fmt.words()..];
    let (w, sh) = (at / 32, u32::try_from(at % 32).expect("below 32"));
    let mut c = words[w] >> sh;
    if sh + fmt.bits > 32 {
        c |= words[w + 1] << (32 - sh);
    }
    c &= (1 << fmt.bits) - 1;
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_wrap,
        reason = "codes, offsets and sub-block scales are below 256"
    )]
    let (q, sc) = (
        if fmt.table == Table::None {
            (c as i32 - fmt.offset as i32) as f32
        } else {
            fmt.table.value(c) as f32
        },
        g.sc.get(gi).map(|&s| s as f32),
    );
    let d = g.d[bi];
    match (fmt.term, sc) {
        // Q4_1, Q5_1: `q · d + m` (without a min nothing is added: `−0.0 + 0.0` would turn
        // ggml's `−0` into `+0`).
        (Term::Min, _) => q * d + g.m[bi],
        // Q2_K, Q4_K, Q5_K: `(d · sc) · q − dmin · m`.
        #[allow(clippy::cast_precision_loss, reason = "6-bit mins")]
        (Term::KMin, Some(sc)) => d * sc * q - g.m[bi] * g.mn[gi] as f32,
        // Q3_K, Q6_K, IQ4_XS: `(d · sc) · q`.
        (_, Some(sc)) => d * sc * q,
        // Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4, NVFP4: `q · d`.
        (_, None) => q * d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The group layout reads back, bit for bit, what ggml's dequantizer (specula-quant's)
    /// computes, for every format it covers.
    #[test]
    fn unpacked_groups_are_the_dequantizer() {
        let n = 512;
        #[allow(clippy::cast_precision_loss, reason = "small ints")]
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0 * (1.0 + (i as f32 * 0.1).sin()))
            .collect();
        for ty in [
            QType::Q8_0,
            QType::Q4_0,
            QType::Q4_1,
            QType::Q5_0,
            QType::Q5_1,
            QType::Q4_K,
            QType::Q5_K,
            QType::Q6_K,
            QType::Q2_K,
            QType::Q3_K,
            QType::IQ4_XS,
            QType::IQ4_NL,
            QType::MXFP4,
            QType::NVFP4,
        ] {
            let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
            specula_quant::quantize_row(ty, &x, &mut bytes).unwrap();
            let mut want = vec![0f32; n];
            specula_quant::dequantize_row(ty, &bytes, &mut want).unwrap();
            let fmt = GroupFormat::of(ty).unwrap();
            let g = unpack(ty, &bytes);
            assert_eq!(g.d.len(), n / fmt.block as usize, "{ty}");
            for (i, &w) in want.iter().enumerate() {
                let got = value(fmt, &g, i);
                assert_eq!(got.to_bits(), w.to_bits(), "{ty} value {i}: {got} vs {w}");
            }
        }
    }
}
