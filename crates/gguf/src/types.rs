//! ggml tensor types as they appear in GGUF tensor infos.
//!
//! Ids, block sizes and byte sizes follow `ggml/include/ggml.h` and gguf-py's
//! `GGML_QUANT_SIZES` (gguf 0.19.0). One deliberate difference: gguf-py lists `Q8_1` as 40
//! bytes, while ggml's `block_q8_1` is `{f16 d, f16 s, i8 qs[32]}` = 36 bytes; we follow ggml,
//! which is what writes and reads the data. `Q8_1` never appears in model files.

use std::fmt;

macro_rules! ggml_types {
    ($( $variant:ident = $id:literal, $name:literal, $block:literal, $bytes:literal; )*) => {
        /// A ggml tensor element type (`enum ggml_type`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[allow(non_camel_case_types, reason = "names follow ggml's GGML_TYPE_* spelling")]
        pub enum GgmlType {
            $( #[doc = concat!("`", $name, "`: id ", $id, ", ", $block, " values in ", $bytes, " bytes.")]
               $variant, )*
        }

        impl GgmlType {
            /// Every type this crate knows, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// The type for a ggml type id, or `None` for ids that are unknown or were removed
            /// from ggml (4, 5, 31–33, 36–38).
            #[must_use]
            pub fn from_id(id: u32) -> Option<Self> {
                match id { $( $id => Some(GgmlType::$variant), )* _ => None }
            }

            /// The ggml type id stored in GGUF tensor infos.
            #[must_use]
            pub fn id(self) -> u32 {
                match self { $( GgmlType::$variant => $id, )* }
            }

            /// The name gguf-py and llama.cpp print (`Q4_K`, `F32`, …).
            #[must_use]
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$variant => $name, )* }
            }

            /// Number of values in one block (1 for plain scalar types).
            #[must_use]
            pub fn block_size(self) -> u64 {
                match self { $( GgmlType::$variant => $block, )* }
            }

            /// Bytes taken by one block.
            #[must_use]
            pub fn type_size(self) -> u64 {
                match self { $( GgmlType::$variant => $bytes, )* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 18;
    Q4_1 = 3, "Q4_1", 32, 20;
    Q5_0 = 6, "Q5_0", 32, 22;
    Q5_1 = 7, "Q5_1", 32, 24;
    Q8_0 = 8, "Q8_0", 32, 34;
    Q8_1 = 9, "Q8_1", 32, 36;
    Q2_K = 10, "Q2_K", 256, 84;
    Q3_K = 11, "Q3_K", 256, 110;
    Q4_K = 12, "Q4_K", 256, 144;
    Q5_K = 13, "Q5_K", 256, 176;
    Q6_K = 14, "Q6_K", 256, 210;
    Q8_K = 15, "Q8_K", 256, 292;
    IQ2_XXS = 16, "IQ2_XXS", 256, 66;
    IQ2_XS = 17, "IQ2_XS", 256, 74;
    IQ3_XXS = 18, "IQ3_XXS", 256, 98;
    IQ1_S = 19, "IQ1_S", 256, 50;
    IQ4_NL = 20, "IQ4_NL", 32, 18;
    IQ3_S = 21, "IQ3_S", 256, 110;
    IQ2_S = 22, "IQ2_S", 256, 82;
    IQ4_XS = 23, "IQ4_XS", 256, 136;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", 256, 56;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", 256, 54;
    TQ2_0 = 35, "TQ2_0", 256, 66;
    MXFP4 = 39, "MXFP4", 32, 17;
    NVFP4 = 40, "NVFP4", 64, 36;
    Q1_0 = 41, "Q1_0", 128, 18;
}

impl GgmlType {
    /// Bytes of a row of `n` values, or `None` when `n` is not a whole number of blocks or the
    /// byte count overflows.
    #[must_use]
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    /// Bits per weight of this type (`8 · type_size / block_size`).
    #[must_use]
    #[allow(
        clippy::cast_precision_loss,
        reason = "sizes are tiny constants, exactly representable in f64"
    )]
    pub fn bits_per_weight(self) -> f64 {
        8.0 * self.type_size() as f64 / self.block_size() as f64
    }

    /// Looks a type up by its printed name, case-insensitively (`q4_k`, `Q4_K`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_removed_ids_are_unknown() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(&t.name().to_lowercase()), Some(t));
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, 1000] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
    }

    #[test]
    fn bits_per_weight_of_common_types() {
        assert!((GgmlType::Q8_0.bits_per_weight() - 8.5).abs() < 1e-12);
        assert!((GgmlType::Q4_K.bits_per_weight() - 4.5).abs() < 1e-12);
        assert!((GgmlType::Q6_K.bits_per_weight() - 6.5625).abs() < 1e-12);
        assert!((GgmlType::MXFP4.bits_per_weight() - 4.25).abs() < 1e-12);
        assert_eq!(GgmlType::NVFP4.row_bytes(64), Some(36));
        assert_eq!(GgmlType::NVFP4.row_bytes(16), None);
    }
}
