//! Bit-exactness against golden vectors made by independent implementations.
//!
//! `golden/quant/` (written by `reference/quant_golden.py`, described in its `MANIFEST.md` and
//! `index.json`) holds a common input of 32 rows × 512 f32 values and, for every format, the
//! bytes gguf-py 0.19.0, ggml C (llama.cpp vendored by llama-cpp-python 0.3.36) or a numpy
//! reimplementation of the TurboQuant fork's reference quantizer made of those rows, plus
//! random blocks and the values those oracles decode them to.
//!
//! - Quantizers: `quantize_row` on each input row must reproduce the golden bytes exactly
//!   (IQ4_NL: the `ntry = 7` search of `ggml_quantize_chunk`; the KV-cache variant is checked
//!   through [`specula_quant::iq4::quantize_row_iq4_nl_ref`]).
//! - Turbo quantizers: codes exactly, the fp16 norm within one unit in the last place (the
//!   fork's own CPU and CUDA paths differ by that much).
//! - Dequantizers: every f32 bit for bit.

use std::fmt::Write as _;
use std::path::PathBuf;

use specula_quant::blocks::BlockIq4Nl;
use specula_quant::{QType, dequantize_row, quantize_row};

const ROWS: usize = 32;
const N_PER_ROW: usize = 512;
/// Mismatches printed in full before the rest are only counted.
const SHOW: usize = 6;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden/quant")
}

fn read(rel: &str) -> Vec<u8> {
    let path = golden_dir().join(rel);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {} ({e}); it is written by reference/quant_golden.py",
            path.display()
        )
    })
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    assert_eq!(bytes.len() % 4, 0, "not a whole number of f32");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn input() -> Vec<f32> {
    let x = f32s(&read("input.f32"));
    assert_eq!(x.len(), ROWS * N_PER_ROW, "input.f32 geometry");
    x
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

fn qtype(name: &str) -> QType {
    QType::from_name(name).unwrap_or_else(|| panic!("no QType named {name}"))
}

/// Collects block mismatches and fails with a short report.
struct Report {
    what: String,
    lines: Vec<String>,
    count: usize,
    blocks: usize,
}

impl Report {
    fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            lines: Vec::new(),
            count: 0,
            blocks: 0,
        }
    }

    fn add(&mut self, line: impl FnOnce() -> String) {
        self.count += 1;
        if self.lines.len() < SHOW {
            self.lines.push(line());
        }
    }

    fn finish(self) {
        if self.count == 0 {
            eprintln!("{}: {} blocks identical", self.what, self.blocks);
            return;
        }
        let more = self.count.saturating_sub(self.lines.len());
        panic!(
            "{}: {} of {} blocks differ\n  {}{}",
            self.what,
            self.count,
            self.blocks,
            self.lines.join("\n  "),
            if more > 0 {
                format!("\n  … and {more} more")
            } else {
                String::new()
            }
        );
    }
}

/// Compares the rows `quantize` makes of input.f32 with `quantize/<file>.bin`, block by block.
/// Blocks listed in `index.json` under `codes_unspecified_blocks` (numbered across rows) are
/// compared on their 2-byte scale only: the oracle leaves their codes undefined.
fn check_quantized(ty: QType, file: &str, quantize: impl Fn(&[f32], &mut [u8])) {
    let index: serde_json::Value =
        serde_json::from_slice(&read("index.json")).expect("index.json is JSON");
    let scale_only: Vec<usize> =
        index["files"][format!("quantize/{file}.bin")]["codes_unspecified_blocks"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|b| usize::try_from(b).ok())
                            .expect("block numbers")
                    })
                    .collect()
            })
            .unwrap_or_default();
    let x = input();
    let golden = read(&format!("quantize/{file}.bin"));
    let row_bytes = ty
        .row_bytes(N_PER_ROW)
        .expect("512 is a whole number of blocks");
    assert_eq!(golden.len(), ROWS * row_bytes, "{file}.bin geometry");
    let size = ty.type_size();
    let mut report = Report::new(format!("quantize {file}"));
    for (row, (xr, gr)) in x
        .chunks_exact(N_PER_ROW)
        .zip(golden.chunks_exact(row_bytes))
        .enumerate()
    {
        let mut ours = vec![0u8; row_bytes];
        quantize(xr, &mut ours);
        for (blk, (o, g)) in ours
            .chunks_exact(size)
            .zip(gr.chunks_exact(size))
            .enumerate()
        {
            report.blocks += 1;
            let compared = if scale_only.contains(&(row * (row_bytes / size) + blk)) {
                2
            } else {
                size
            };
            if o[..compared] != g[..compared] {
                report.add(|| {
                    format!(
                        "row {row} block {blk}:\n    golden {}\n    ours   {}",
                        hex(g),
                        hex(o)
                    )
                });
            }
        }
    }
    report.finish();
}

fn check_quantize(name: &str) {
    let ty = qtype(name);
    check_quantized(ty, name, |x, y| {
        quantize_row(ty, x, y).expect("row lengths are right");
    });
}

/// Turbo: identical codes (every byte after the 2-byte norm), fp16 norm within ±1 ulp.
fn check_quantize_turbo(name: &str) {
    let ty = qtype(name);
    let x = input();
    let golden = read(&format!("quantize/{name}.bin"));
    let row_bytes = ty.row_bytes(N_PER_ROW).expect("whole groups");
    assert_eq!(golden.len(), ROWS * row_bytes, "{name}.bin geometry");
    let size = ty.type_size();
    let mut report = Report::new(format!("quantize {name}"));
    let mut norm_off_by_one = 0;
    for (row, (xr, gr)) in x
        .chunks_exact(N_PER_ROW)
        .zip(golden.chunks_exact(row_bytes))
        .enumerate()
    {
        let mut ours = vec![0u8; row_bytes];
        quantize_row(ty, xr, &mut ours).expect("row lengths are right");
        for (blk, (o, g)) in ours
            .chunks_exact(size)
            .zip(gr.chunks_exact(size))
            .enumerate()
        {
            report.blocks += 1;
            let (no, ng) = (
                u16::from_le_bytes([o[0], o[1]]),
                u16::from_le_bytes([g[0], g[1]]),
            );
            let ulps = (i32::from(no) - i32::from(ng)).abs();
            norm_off_by_one += usize::from(ulps == 1);
            if o[2..] != g[2..] || ulps > 1 {
                let codes = o[2..].iter().zip(&g[2..]).filter(|(a, b)| a != b).count();
                report.add(|| {
                    format!(
                        "row {row} group {blk}: norm bits golden {ng:#06x} ours {no:#06x}, \
                         {codes} code bytes differ\n    golden {}\n    ours   {}",
                        hex(g),
                        hex(o)
                    )
                });
            }
        }
    }
    eprintln!("quantize {name}: {norm_off_by_one} norms 1 fp16 ulp off (allowed)");
    report.finish();
}

/// `dequantize_row` on `dequantize/<name>.in` must give `<name>.out` bit for bit.
fn check_dequantize(name: &str) {
    let ty = qtype(name);
    let input = read(&format!("dequantize/{name}.in"));
    let golden = f32s(&read(&format!("dequantize/{name}.out")));
    let mut ours = vec![f32::NAN; golden.len()];
    dequantize_row(ty, &input, &mut ours).expect("golden geometry matches the format");
    let (bs, size) = (ty.block_size(), ty.type_size());
    let mut report = Report::new(format!("dequantize {name}"));
    for (blk, ((o, g), bytes)) in ours
        .chunks_exact(bs)
        .zip(golden.chunks_exact(bs))
        .zip(input.chunks_exact(size))
        .enumerate()
    {
        report.blocks += 1;
        let bad: Vec<usize> = (0..bs)
            .filter(|&i| o[i].to_bits() != g[i].to_bits())
            .collect();
        if let Some(&i) = bad.first() {
            report.add(|| {
                format!(
                    "block {blk} ({} values differ; first: element {i}, golden {:e} ({:#010x}), \
                     ours {:e} ({:#010x}))\n    block {}",
                    bad.len(),
                    g[i],
                    g[i].to_bits(),
                    o[i],
                    o[i].to_bits(),
                    hex(bytes)
                )
            });
        }
    }
    report.finish();
}

macro_rules! golden_tests {
    ($($name:ident),* $(,)?) => {
        mod quantize {
            $( #[test] fn $name() { super::check_quantize(stringify!($name)); } )*
        }
        mod dequantize {
            $( #[test] fn $name() { super::check_dequantize(stringify!($name)); } )*
        }
    };
}

golden_tests!(
    f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k, iq4_nl,
    iq4_xs, mxfp4, nvfp4,
);

mod turbo {
    #[test]
    fn quantize_turbo2() {
        super::check_quantize_turbo("turbo2");
    }
    #[test]
    fn quantize_turbo3() {
        super::check_quantize_turbo("turbo3");
    }
    #[test]
    fn quantize_turbo4() {
        super::check_quantize_turbo("turbo4");
    }
    #[test]
    fn dequantize_turbo2() {
        super::check_dequantize("turbo2");
    }
    #[test]
    fn dequantize_turbo3() {
        super::check_dequantize("turbo3");
    }
    #[test]
    fn dequantize_turbo4() {
        super::check_dequantize("turbo4");
    }
}

/// The KV-cache IQ4_NL quantizer (`quantize_row_iq4_nl_ref`, ntry = −1) through the typed
/// function. ggml leaves the codes of blocks with max |x| < 1e-15 as whatever its scratch
/// buffer held, so for those (listed in `index.json`) only the zero scale is compared.
#[test]
fn quantize_iq4_nl_ref() {
    check_quantized(QType::IQ4_NL, "iq4_nl_ref", |x, y| {
        specula_quant::iq4::quantize_row_iq4_nl_ref(
            x,
            bytemuck::cast_slice_mut::<u8, BlockIq4Nl>(y),
        );
    });
}

/// The fork's forward rotation (`turbo_cpu_fwht`: signs, butterflies, × `0.08838834764831845f`
/// · s2) of every 128-value group of input.f32, bit for bit: the turbo codes depend on it.
#[test]
fn wht_forward() {
    let x = input();
    let golden = f32s(&read("wht/forward.f32"));
    assert_eq!(golden.len(), x.len(), "wht/forward.f32 geometry");
    let mut report = Report::new("wht forward");
    for (grp, (xg, gg)) in x
        .chunks_exact(specula_quant::wht::GROUP)
        .zip(golden.chunks_exact(specula_quant::wht::GROUP))
        .enumerate()
    {
        report.blocks += 1;
        let mut ours: [f32; specula_quant::wht::GROUP] = xg.try_into().expect("whole group");
        specula_quant::wht::forward(&mut ours);
        let bad: Vec<usize> = (0..ours.len())
            .filter(|&i| ours[i].to_bits() != gg[i].to_bits())
            .collect();
        if let Some(&i) = bad.first() {
            report.add(|| {
                format!(
                    "row {} group {} ({} values differ; first: element {i}, golden {:e} \
                     ({:#010x}), ours {:e} ({:#010x}))",
                    grp / 4,
                    grp % 4,
                    bad.len(),
                    gg[i],
                    gg[i].to_bits(),
                    ours[i],
                    ours[i].to_bits()
                )
            });
        }
    }
    report.finish();
}

/// Every format except f32 has goldens, and `index.json` describes each file with the
/// geometry the tests assume.
#[test]
fn every_format_has_goldens() {
    let index: serde_json::Value =
        serde_json::from_slice(&read("index.json")).expect("index.json is JSON");
    let files = index["files"].as_object().expect("index.json has files");
    for &ty in QType::ALL {
        if ty == QType::F32 {
            continue;
        }
        let q = format!("quantize/{}.bin", ty.name());
        let entry = files
            .get(&q)
            .unwrap_or_else(|| panic!("index.json lacks {q}"));
        assert_eq!(entry["rows"], ROWS, "{q}");
        assert_eq!(entry["n_per_row"], N_PER_ROW, "{q}");
        assert!(
            entry["producer"].as_str().is_some_and(|p| !p.is_empty()),
            "{q}: no producer"
        );
        for suffix in ["in", "out"] {
            let d = format!("dequantize/{}.{suffix}", ty.name());
            assert!(files.contains_key(&d), "index.json lacks {d}");
            assert!(golden_dir().join(&d).is_file(), "{d} missing");
        }
        assert!(golden_dir().join(&q).is_file(), "{q} missing");
    }
    assert!(files.contains_key("quantize/iq4_nl_ref.bin"));
}
