//! Matrices the models multiply by, with llama.cpp's optional per-tensor scale.
//!
//! An NVFP4 export (NVIDIA ModelOpt) stores a matrix `W` as the FP4 blocks of `W / s` and the
//! FP32 scale `s` as a separate one-element tensor `<name>.scale`; llama.cpp's loader reads it
//! for every matmul weight of a model (`llama-model.cpp`, the generic pass over `wq_s`, `wk_s`,
//! …, `ffn_down_s`, `output_s`) and its graph multiplies the product by it
//! (`build_lora_mm(w, x, w_s)`). [`Linear`] is that pair, and [`Linear::matmul`] the one place
//! it is applied — in every architecture's target forward and in the DFlash and EAGLE-3
//! drafters alike. Tensors llama.cpp would read that no loaded [`Linear`] applies (an
//! activation `<name>.input_scale`, a scale of a weight this architecture does not multiply
//! through a [`Linear`]) are refused at load by name ([`Scales::check`]): without them the
//! model would compute something else.

use std::borrow::Borrow;
use std::cell::RefCell;

use specula_gguf::Gguf;
use specula_tensor::Backend;

use crate::{ModelError, Result};

/// A matrix with its optional per-tensor scale: every product with it is multiplied by the
/// scale (llama.cpp's `build_lora_mm(w, x, w_s)`). `W` is the backend's weight or a shared
/// handle to one (an `Arc` of a head a drafter borrows from its target).
#[derive(Debug, Clone)]
pub struct Linear<W> {
    /// The matrix.
    pub w: W,
    /// The per-tensor scale (`<name>.scale`), when the file has one.
    pub scale: Option<f32>,
}

impl<W> Linear<W> {
    /// `out = (x · wᵀ) · scale` (the scale only when there is one).
    pub fn matmul<B: Backend>(&self, be: &B, x: &B::Tensor, out: &mut B::Tensor)
    where
        W: Borrow<B::Weight>,
    {
        be.matmul(x, self.w.borrow(), out);
        if let Some(s) = self.scale {
            be.scale(out, s);
        }
    }
}

/// Reads the per-tensor scale `<base>.scale` (F32, one element) if the file has one.
///
/// # Errors
/// [`ModelError::BadShape`] when it is not one F32 value.
pub(crate) fn tensor_scale(file: &Gguf, base: &str) -> Result<Option<f32>> {
    let name = format!("{base}.scale");
    let Some(info) = file.tensor(&name) else {
        return Ok(None);
    };
    let data = file.tensor_data_by_name(&name).unwrap_or(&[]);
    if info.ty != specula_gguf::GgmlType::F32 || info.n_elements() != 1 || data.len() != 4 {
        return Err(ModelError::BadShape {
            name,
            expected: vec![1],
            got: crate::dims_of(info),
        });
    }
    let s = f32::from_le_bytes([data[0], data[1], data[2], data[3]]);
    if !s.is_finite() {
        return Err(ModelError::BadScale { name, value: s });
    }
    Ok(Some(s))
}

/// The matrices of a file whose scales a model applies, so that every other scale tensor can
/// be refused ([`Scales::check`]).
#[derive(Debug, Default)]
pub(crate) struct Scales {
    applied: RefCell<Vec<String>>,
}

impl Scales {
    /// The scale of matrix `<base>.weight`, recorded as applied.
    pub(crate) fn read(&self, file: &Gguf, base: &str) -> Result<Option<f32>> {
        self.applied.borrow_mut().push(base.to_owned());
        tensor_scale(file, base)
    }

    /// Records `<base>.scale` as applied by a caller that reads it itself (Gemma 4's router
    /// input scale, a vector).
    pub(crate) fn mark_applied(&self, base: &str) {
        self.applied.borrow_mut().push(base.to_owned());
    }

    /// The per-expert scales of the stacked expert matrices `<base>.weight` (`<base>.scale`,
    /// F32 `[n_expert]`, llama.cpp's `ffn_*_exps_s`), recorded as applied.
    ///
    /// # Errors
    /// [`ModelError::BadShape`] when it is not `n_expert` F32 values, [`ModelError::BadScale`]
    /// for a value that is not finite.
    pub(crate) fn read_per_expert(
        &self,
        file: &Gguf,
        base: &str,
        n_expert: usize,
    ) -> Result<Option<Vec<f32>>> {
        self.applied.borrow_mut().push(base.to_owned());
        let name = format!("{base}.scale");
        let Some(info) = file.tensor(&name) else {
            return Ok(None);
        };
        let data = file.tensor_data_by_name(&name).unwrap_or(&[]);
        let dims: Vec<usize> = crate::dims_of(info);
        if info.ty != specula_gguf::GgmlType::F32
            || dims != [n_expert]
            || data.len() != 4 * n_expert
        {
            return Err(ModelError::BadShape {
                name,
                expected: vec![n_expert],
                got: dims,
            });
        }
        let v: Vec<f32> = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(&bad) = v.iter().find(|s| !s.is_finite()) {
            return Err(ModelError::BadScale { name, value: bad });
        }
        Ok(Some(v))
    }

    /// Refuses every `<name>.input_scale` (an activation scale: specula does not quantize
    /// activations with it) and every `<name>.scale` of a matrix no [`Linear`] of the model
    /// applies.
    ///
    /// # Errors
    /// [`ModelError::UnappliedScale`] naming the first such tensor.
    pub(crate) fn check(&self, file: &Gguf) -> Result<()> {
        let applied = self.applied.borrow();
        for t in file.tensors() {
            if t.name.ends_with(".input_scale") {
                return Err(ModelError::UnappliedScale {
                    name: t.name.clone(),
                    what: "an activation scale (NVFP4 input_scale), which specula does not apply",
                });
            }
            if let Some(base) = t.name.strip_suffix(".scale")
                && !applied.iter().any(|a| a == base)
            {
                return Err(ModelError::UnappliedScale {
                    name: t.name.clone(),
                    what: "the scale of a tensor this model does not multiply by as a scaled \
                           matrix",
                });
            }
        }
        Ok(())
    }
}
