//! Weights on the device: every integer block format unpacked, once at upload, into one
//! group layout the kernels share.
//!
//! A GGUF block format stores, per block, one or two f16 scales and bit-packed codes, in a
//! byte layout of its own (a 34-byte `block_q8_0`, a 144-byte `block_q4_K` with 6-bit
//! sub-block scales). On the device every such format becomes groups of `group` values
//! (32, or 16 for Q6_K), each with
//!
//! - `scale` (f32): the group's step, already multiplied out as ggml's dequantizer does
//!   (`d · sc` for the K-quants),
//! - `min` (f32, formats with a min only): the offset added (`−dmin · m` for Q4_K/Q5_K, `m` for
//!   Q4_1/Q5_1),
//! - codes of `bits` bits each, packed little-endian into u32 words (`group · bits / 32` words
//!   per group), stored unsigned with the format's `offset` subtracted when read.
//!
//! so that value `i` of a group is `scale · (code_i − offset) + min`, bit for bit what ggml's
//! dequantizer computes. One kernel, specialised at compile time by [`GroupFormat`], then
//! serves every format: the combinations are generated, not hand-copied. The price is a few
//! bytes per group (an f32 scale instead of an f16; Q4_0 reads 5 bits per weight instead of
//! 4.5) — measured in `docs/perf.md`.

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

/// How a format's groups read: the compile-time parameters of the matmul and row kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupFormat {
    /// Bits per code.
    pub bits: u32,
    /// Values per group (32, or 16 for Q6_K).
    pub group: u32,
    /// Subtracted from each code (8 for Q4_0, 128 for Q8_0's signed bytes stored biased).
    pub offset: u32,
    /// Whether groups carry a min.
    pub has_min: bool,
    /// Activation quantization of the dot product.
    pub act: ActQuant,
}

impl GroupFormat {
    /// The group layout of `ty`, or `None` for a format the device keeps as floats (f32,
    /// f16, bf16) or does not support yet.
    #[must_use]
    pub fn of(ty: QType) -> Option<Self> {
        let f = |bits, group, offset, has_min, act| Self {
            bits,
            group,
            offset,
            has_min,
            act,
        };
        Some(match ty {
            QType::Q8_0 => f(8, 32, 128, false, ActQuant::Q8_0),
            QType::Q4_0 => f(4, 32, 8, false, ActQuant::Q8_0),
            QType::Q5_0 => f(5, 32, 16, false, ActQuant::Q8_0),
            QType::Q4_1 => f(4, 32, 0, true, ActQuant::Q8_1),
            QType::Q5_1 => f(5, 32, 0, true, ActQuant::Q8_1),
            QType::Q4_K => f(4, 32, 0, true, ActQuant::Q8K),
            QType::Q5_K => f(5, 32, 0, true, ActQuant::Q8K),
            QType::Q6_K => f(6, 16, 32, false, ActQuant::Q8K),
            _ => return None,
        })
    }

    /// u32 words of codes per group.
    #[must_use]
    pub fn words(self) -> usize {
        (self.group * self.bits / 32) as usize
    }
}

/// One weight matrix in the group layout, on the host (before upload).
#[derive(Clone, Debug, Default)]
pub struct Groups {
    /// Per group, its step.
    pub scales: Vec<f32>,
    /// Per group, its min (empty for formats without one).
    pub mins: Vec<f32>,
    /// Codes, [`GroupFormat::words`] per group.
    pub codes: Vec<u32>,
}

fn half(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Unpacks every block of `bytes` (whole blocks of `ty`) into the group layout.
///
/// # Panics
/// If `ty` has no group layout ([`GroupFormat::of`]) or `bytes` is not whole blocks; the
/// backend checks both before calling.
#[must_use]
pub fn unpack(ty: QType, bytes: &[u8]) -> Groups {
    let fmt = GroupFormat::of(ty).expect("a format with a group layout");
    let bs = ty.type_size();
    assert_eq!(bytes.len() % bs, 0, "whole blocks");
    let mut g = Groups::default();
    let mut codes = [0u8; 256];
    for b in bytes.chunks_exact(bs) {
        // (scale, min) per group of this block, codes into `codes`.
        let mut groups: [(f32, f32); 16] = [(0.0, 0.0); 16];
        let n_groups = match ty {
            QType::Q8_0 => {
                groups[0] = (half(b, 0), 0.0);
                for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
                    *c = q ^ 0x80; // two's complement byte + 128
                }
                1
            }
            QType::Q4_0 | QType::Q4_1 => {
                let (qs, sm) = if ty == QType::Q4_0 {
                    (&b[2..18], (half(b, 0), 0.0))
                } else {
                    (&b[4..20], (half(b, 0), half(b, 2)))
                };
                groups[0] = sm;
                for (j, &q) in qs.iter().enumerate() {
                    codes[j] = q & 0xF;
                    codes[j + 16] = q >> 4;
                }
                1
            }
            QType::Q5_0 | QType::Q5_1 => {
                let (qh, qs, sm) = if ty == QType::Q5_0 {
                    (&b[2..6], &b[6..22], (half(b, 0), 0.0))
                } else {
                    (&b[4..8], &b[8..24], (half(b, 0), half(b, 2)))
                };
                groups[0] = sm;
                let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
                for (j, &q) in qs.iter().enumerate() {
                    let hi = |bit: usize| u8::from((qh >> bit) & 1 == 1) << 4;
                    codes[j] = (q & 0xF) | hi(j);
                    codes[j + 16] = (q >> 4) | hi(j + 16);
                }
                1
            }
            QType::Q4_K | QType::Q5_K => {
                let (d, dmin) = (half(b, 0), half(b, 2));
                let sc: &[u8; 12] = b[4..16].try_into().expect("12 scale bytes");
                let (qh, qs) = if ty == QType::Q4_K {
                    (None, &b[16..144])
                } else {
                    (Some(&b[16..48]), &b[48..176])
                };
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, sc);
                    groups[j] = (d * f32::from(s), -(dmin * f32::from(m)));
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
                8
            }
            QType::Q6_K => {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = half(b, 208);
                for (j, &s) in sc.iter().enumerate() {
                    groups[j] = (d * f32::from(s.cast_signed()), 0.0);
                }
                for n in 0..2 {
                    let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                    for l in 0..32 {
                        let y = &mut codes[128 * n..];
                        y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                        y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                        y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    }
                }
                16
            }
            _ => unreachable!("GroupFormat::of covers the formats unpacked here"),
        };
        let group = fmt.group as usize;
        for (gi, &(s, m)) in groups[..n_groups].iter().enumerate() {
            g.scales.push(s);
            if fmt.has_min {
                g.mins.push(m);
            }
            pack(&codes[gi * group..(gi + 1) * group], fmt.bits, &mut g.codes);
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
        let (w, sh) = (at / 32, (at % 32) as u32);
        words[w] |= u32::from(c) << sh;
        if sh + bits > 32 {
            words[w + 1] |= u32::from(c) >> (32 - sh);
        }
    }
}

/// Value `i` of group `g`, as the kernels read it (the host mirror of the device decoder).
#[must_use]
pub fn value(fmt: GroupFormat, g: &Groups, gi: usize, i: usize) -> f32 {
    let at = i * fmt.bits as usize;
    let words = &g.codes[gi * fmt.words()..];
    let (w, sh) = (at / 32, (at % 32) as u32);
    let mut c = words[w] >> sh;
    if sh + fmt.bits > 32 {
        c |= words[w + 1] << (32 - sh);
    }
    c &= (1 << fmt.bits) - 1;
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_wrap,
        reason = "codes and offsets are below 256"
    )]
    let q = (c as i32 - fmt.offset as i32) as f32;
    // Without a min nothing is added: `−0.0 + 0.0` would turn ggml's `−0` into `+0`.
    let v = g.scales[gi] * q;
    if fmt.has_min { v + g.mins[gi] } else { v }
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
        ] {
            let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
            specula_quant::quantize_row(ty, &x, &mut bytes).unwrap();
            let mut want = vec![0f32; n];
            specula_quant::dequantize_row(ty, &bytes, &mut want).unwrap();
            let fmt = GroupFormat::of(ty).unwrap();
            let g = unpack(ty, &bytes);
            let group = fmt.group as usize;
            assert_eq!(g.scales.len(), n / group, "{ty}");
            for (i, &w) in want.iter().enumerate() {
                let got = value(fmt, &g, i / group, i % group);
                assert_eq!(got.to_bits(), w.to_bits(), "{ty} value {i}: {got} vs {w}");
            }
        }
    }
}
