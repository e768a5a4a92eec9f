//! Rows a drafter keeps on its backend — target features waiting to be encoded or injected,
//! EAGLE-3's encoded `g` rows — so that they never travel to the host and back: a tensor
//! with room to grow and the count of its rows in use.

use std::ops::Range;

use specula_spec::SpecError;
use specula_tensor::Backend;

/// Host features `[tokens, width]` uploaded to `be` for a drafter that keeps them there
/// ([`specula_spec::Drafter::process_features`] of a drafter that reads them on the backend).
pub(crate) fn upload<B: Backend>(
    be: &B,
    drafter: &'static str,
    tokens: usize,
    width: usize,
    features: &[f32],
) -> Result<B::Tensor, SpecError> {
    if features.len() != tokens * width {
        return Err(SpecError::Features {
            drafter,
            got: features.len(),
            tokens,
            width,
        });
    }
    Ok(be.from_host(tokens, width, features))
}

/// The backend tensor behind type-erased device features
/// ([`specula_spec::Drafter::process_device_features`]), if they are `B`'s.
pub(crate) fn on_backend<'a, B: Backend>(
    drafter: &'static str,
    features: &'a (dyn std::any::Any + Send + Sync),
) -> Result<&'a B::Tensor, SpecError> {
    features
        .downcast_ref::<B::Tensor>()
        .ok_or(SpecError::DeviceFeatures { drafter })
}

/// The first `n` rows of `t` (`[capacity, width]`).
pub(crate) struct DevRows<B: Backend> {
    t: B::Tensor,
    n: usize,
}

impl<B: Backend> DevRows<B> {
    /// No rows, `width` wide.
    pub(crate) fn new(be: &B, width: usize) -> Self {
        Self {
            t: be.zeros(0, width),
            n: 0,
        }
    }

    /// Rows in use.
    pub(crate) fn len(&self) -> usize {
        self.n
    }

    /// The tensor (its first [`DevRows::len`] rows are the rows).
    pub(crate) fn tensor(&self) -> &B::Tensor {
        &self.t
    }

    /// Keeps the first `n` rows.
    pub(crate) fn truncate(&mut self, n: usize) {
        self.n = self.n.min(n);
    }

    /// Appends rows `rows` of `src` (of this width).
    pub(crate) fn append(&mut self, be: &B, src: &B::Tensor, rows: Range<usize>) {
        let m = rows.len();
        if m == 0 {
            return;
        }
        let (cap, width) = be.shape(&self.t);
        let mut tmp = be.zeros(0, width);
        if cap < self.n + m {
            // Room to grow by doubling: each row is copied once per doubling.
            let mut grown = be.zeros((self.n + m).max(2 * cap).max(16), width);
            if self.n > 0 {
                let kept = be.index_range(0..self.n);
                be.copy_rows(&self.t, &kept, &mut tmp);
                be.put_rows(&tmp, &kept, &mut grown);
            }
            self.t = grown;
        }
        let from = be.index_range(rows);
        let to = be.index_range(self.n..self.n + m);
        be.copy_rows(src, &from, &mut tmp);
        be.put_rows(&tmp, &to, &mut self.t);
        self.n += m;
    }

    /// Appends every row of `other`.
    pub(crate) fn extend(&mut self, be: &B, other: &Self) {
        self.append(be, &other.t, 0..other.n);
    }

    /// Removes the first `d` rows and returns them.
    pub(crate) fn drain_front(&mut self, be: &B, d: usize) -> Self {
        let d = d.min(self.n);
        let head = self.head(be, d);
        if d > 0 && d < self.n {
            let mut tmp = be.zeros(0, 0);
            let rest = be.index_range(d..self.n);
            be.copy_rows(&self.t, &rest, &mut tmp);
            let to = be.index_range(0..self.n - d);
            be.put_rows(&tmp, &to, &mut self.t);
        }
        self.n -= d;
        head
    }

    /// A copy of the first `n` rows.
    pub(crate) fn head(&self, be: &B, n: usize) -> Self {
        let n = n.min(self.n);
        let mut t = be.zeros(0, be.shape(&self.t).1);
        if n > 0 {
            let rows = be.index_range(0..n);
            be.copy_rows(&self.t, &rows, &mut t);
        }
        Self { t, n }
    }

    /// A copy of every row.
    pub(crate) fn copy(&self, be: &B) -> Self {
        self.head(be, self.n)
    }
}
