//! A model file's type as llama.cpp names it (`llama_model_ftype_name`): `general.file_type`
//! (`enum llama_ftype`) through `llama_ftype_name`'s table, or, without the key, guessed from
//! the most common tensor type with llama.cpp's `(guessed) ` prefix.

use crate::{GgmlType, Gguf};

/// The name of `llama_ftype` id `id` in `llama_ftype_name`'s table.
#[must_use]
pub fn ftype_name(id: u64) -> &'static str {
    match id {
        0 => "all F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K - Medium",
        11 => "Q3_K - Small",
        12 => "Q3_K - Medium",
        13 => "Q3_K - Large",
        14 => "Q4_K - Small",
        15 => "Q4_K - Medium",
        16 => "Q5_K - Small",
        17 => "Q5_K - Medium",
        18 => "Q6_K",
        19 => "IQ2_XXS - 2.0625 bpw",
        20 => "IQ2_XS - 2.3125 bpw",
        21 => "Q2_K - Small",
        22 => "IQ3_XS - 3.3 bpw",
        23 => "IQ3_XXS - 3.0625 bpw",
        24 => "IQ1_S - 1.5625 bpw",
        25 => "IQ4_NL - 4.5 bpw",
        26 => "IQ3_S - 3.4375 bpw",
        27 => "IQ3_S mix - 3.66 bpw",
        28 => "IQ2_S - 2.5 bpw",
        29 => "IQ2_M - 2.7 bpw",
        30 => "IQ4_XS - 4.25 bpw",
        31 => "IQ1_M - 1.75 bpw",
        32 => "BF16",
        36 => "TQ1_0 - 1.69 bpw ternary",
        37 => "TQ2_0 - 2.06 bpw ternary",
        38 => "MXFP4 MoE",
        39 => "NVFP4",
        40 => "Q1_0",
        41 => "Q2_0",
        _ => "unknown, may not work",
    }
}

/// The `llama_ftype` id llama.cpp guesses for a file whose most common tensor type is `ty`.
fn guessed_id(ty: GgmlType) -> u64 {
    match ty {
        GgmlType::F16 => 1,
        GgmlType::BF16 => 32,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q8_0 => 7,
        GgmlType::Q2_K => 10,
        GgmlType::Q3_K => 12,
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::TQ1_0 => 36,
        GgmlType::TQ2_0 => 37,
        GgmlType::IQ2_XXS => 19,
        GgmlType::IQ2_XS => 20,
        GgmlType::IQ2_S => 28,
        GgmlType::IQ3_XXS => 23,
        GgmlType::IQ1_S => 24,
        GgmlType::IQ1_M => 31,
        GgmlType::IQ4_NL => 25,
        GgmlType::IQ4_XS => 30,
        GgmlType::IQ3_S => 26,
        GgmlType::NVFP4 => 39,
        GgmlType::Q1_0 => 40,
        _ => 0,
    }
}

impl Gguf {
    /// The file type as llama.cpp prints it (`Q4_1`, `Q4_K - Medium`, …): from
    /// `general.file_type`, else `(guessed) ` and the type of most tensors (in name order,
    /// the first type to reach the largest count, as llama.cpp counts them).
    #[must_use]
    pub fn file_type_name(&self) -> String {
        if let Some(id) = self.metadata().get_u64("general.file_type") {
            return ftype_name(id).to_owned();
        }
        let mut tensors: Vec<_> = self.tensors().iter().collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut counts = std::collections::HashMap::new();
        let (mut best, mut max) = (GgmlType::F32, 0);
        for t in tensors {
            let n = counts.entry(t.ty).or_insert(0usize);
            *n += 1;
            if *n > max {
                (best, max) = (t.ty, *n);
            }
        }
        format!("(guessed) {}", ftype_name(guessed_id(best)))
    }

    /// Values in all tensors of the file (llama.cpp's `llama_model_n_params`).
    #[must_use]
    pub fn n_params(&self) -> u64 {
        self.tensors()
            .iter()
            .map(crate::TensorInfo::n_elements)
            .sum()
    }

    /// Bytes of all tensors of the file (llama.cpp's `llama_model_size`).
    #[must_use]
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors().iter().map(crate::TensorInfo::n_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_ftype_name() {
        assert_eq!(ftype_name(15), "Q4_K - Medium");
        assert_eq!(ftype_name(3), "Q4_1");
        assert_eq!(ftype_name(0), "all F32");
        assert_eq!(ftype_name(5), "unknown, may not work");
        assert_eq!(guessed_id(GgmlType::Q4_K), 15);
    }
}
