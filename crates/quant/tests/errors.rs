//! Bad input to the byte-level entry points gets a typed error, never a panic: rows that are
//! not whole blocks, truncated or over-long buffers, unknown type ids and names.

use specula_quant::{QType, QuantError, dequantize_row, quantize_row, vec_dot};

#[test]
fn rows_that_are_not_whole_blocks() {
    for &ty in QType::ALL {
        let bs = ty.block_size();
        if bs == 1 {
            continue;
        }
        let n = bs + 1;
        let err = quantize_row(ty, &vec![0.0; n], &mut vec![0; 2 * ty.type_size()]).unwrap_err();
        assert_eq!(
            err,
            QuantError::RowNotBlockMultiple { ty, n, block: bs },
            "{ty}"
        );
        assert!(err.to_string().contains("not a whole number"), "{err}");
        assert!(matches!(
            dequantize_row(ty, &vec![0; ty.type_size()], &mut vec![0.0; n]),
            Err(QuantError::RowNotBlockMultiple { .. })
        ));
    }
}

#[test]
fn truncated_and_overlong_quantized_rows() {
    for &ty in QType::ALL {
        let n = ty.block_size() * 2;
        let full = ty.row_bytes(n).unwrap();
        for bytes in [full - 1, full + 1, 0] {
            let err = dequantize_row(ty, &vec![0; bytes], &mut vec![0.0; n]).unwrap_err();
            assert_eq!(
                err,
                QuantError::LengthMismatch {
                    ty,
                    what: "the quantized row",
                    expected: full,
                    got: bytes,
                    unit: "bytes"
                },
                "{ty}"
            );
            assert!(matches!(
                quantize_row(ty, &vec![0.0; n], &mut vec![0; bytes]),
                Err(QuantError::LengthMismatch { .. })
            ));
        }
    }
}

#[test]
fn vec_dot_checks_both_rows() {
    let n = 64;
    let w = vec![0u8; QType::Q8_0.row_bytes(n).unwrap()];
    let a = vec![0u8; QType::Q8_0.row_bytes(n).unwrap() - 2];
    assert!(matches!(
        vec_dot(QType::Q8_0, n, &w, &a),
        Err(QuantError::LengthMismatch {
            ty: QType::Q8_0,
            ..
        })
    ));
    assert!(matches!(
        vec_dot(QType::Q4_K, 100, &w, &a),
        Err(QuantError::RowNotBlockMultiple { .. })
    ));
}

#[test]
fn type_lookup() {
    for &ty in QType::ALL {
        assert_eq!(QType::from_name(&ty.name().to_uppercase()), Some(ty));
        if let Some(id) = ty.ggml_id() {
            assert_eq!(QType::from_ggml_id(id), Some(ty));
        }
    }
    assert_eq!(QType::from_ggml_id(42), None);
    assert_eq!(QType::from_ggml_id(16), None, "IQ2_XXS is not implemented");
    assert_eq!(
        QType::from_name("q4_k_m"),
        None,
        "a preset, not a block format"
    );
    // Bits per weight of the table in the research note (quant.md §9).
    let bpw: Vec<f64> = [
        QType::Q8_0,
        QType::Q4_0,
        QType::IQ4_NL,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::MXFP4,
        QType::NVFP4,
        QType::Turbo2,
        QType::Turbo3,
        QType::Turbo4,
    ]
    .iter()
    .map(|t| t.bits_per_weight())
    .collect();
    assert_eq!(
        bpw,
        [
            8.5, 4.5, 4.5, 4.5, 5.5, 6.5625, 4.25, 4.5, 2.125, 3.125, 4.125
        ]
    );
}
