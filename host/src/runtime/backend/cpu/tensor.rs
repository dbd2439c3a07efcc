//! A CPU device's storage: host memory in the tensor's dtype (fp32 or
//! bf16). The kernels compute in fp32 whatever the storage: a bf16 input is
//! widened into an fp32 copy for the call, a bf16 output is computed in an
//! fp32 copy of itself (so kernels that accumulate into their output see its
//! value) and rounded to the nearest bf16, ties to even, when the kernel
//! returns — a mixed-precision GPU kernel's load, fp32 arithmetic and store.
//! An fp32 tensor is handed to the kernel as it is: fp32 runs are the same
//! bits as before storage had a dtype.

use crate::model::Dtype;
use half::bf16;
use half::slice::HalfFloatSliceExt;
use std::borrow::Cow;

/// A tensor on a CPU device.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuTensor {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Default for CpuTensor {
    fn default() -> Self {
        CpuTensor::F32(Vec::new())
    }
}

impl From<Vec<f32>> for CpuTensor {
    fn from(v: Vec<f32>) -> Self {
        CpuTensor::F32(v)
    }
}

/// Elements a conversion hands each thread of the device's pool at a time
/// (below it, one thread converts the whole).
const CHUNK: usize = 1 << 14;

/// `dst[i] = src[i]` converted, over the device's threads when long
/// (elementwise: the same bits on any thread count).
fn convert<S: Sync, D: Send>(dst: &mut [D], src: &[S], f: impl Fn(&mut [D], &[S]) + Sync) {
    use rayon::prelude::*;
    if dst.len() <= CHUNK {
        return f(dst, src);
    }
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| f(d, s));
}

/// `dst` = `src` rounded to bf16 (nearest, ties to even).
fn narrow_into(dst: &mut [bf16], src: &[f32]) {
    convert(dst, src, |d, s| d.convert_from_f32_slice(s));
}

/// `v` rounded to bf16 (nearest, ties to even).
pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; v.len()];
    narrow_into(&mut out, v);
    out
}

/// `v` widened to fp32 (exact).
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    let mut out = vec![0.0f32; v.len()];
    convert(&mut out, v, |d, s| s.convert_to_f32_slice(d));
    out
}

impl CpuTensor {
    /// `n` zeros of `dtype`.
    pub fn zeros(n: usize, dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => CpuTensor::F32(vec![0.0; n]),
            Dtype::Bf16 => CpuTensor::Bf16(vec![bf16::ZERO; n]),
        }
    }

    /// `v` stored as `dtype` (rounded when narrower).
    pub fn from_f32(v: Vec<f32>, dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => CpuTensor::F32(v),
            Dtype::Bf16 => CpuTensor::Bf16(to_bf16(&v)),
        }
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            CpuTensor::F32(_) => Dtype::F32,
            CpuTensor::Bf16(_) => Dtype::Bf16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuTensor::F32(v) => v.len(),
            CpuTensor::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of storage.
    pub fn bytes(&self) -> u64 {
        self.len() as u64 * self.dtype().bytes()
    }

    /// The values in fp32: borrowed when stored so, widened otherwise.
    pub fn f32(&self) -> Cow<'_, [f32]> {
        self.f32_range(0..self.len())
    }

    /// Elements `range` in fp32.
    pub fn f32_range(&self, range: std::ops::Range<usize>) -> Cow<'_, [f32]> {
        match self {
            CpuTensor::F32(v) => Cow::Borrowed(&v[range]),
            CpuTensor::Bf16(v) => Cow::Owned(to_f32(&v[range])),
        }
    }

    /// The values as an owned fp32 vector.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            CpuTensor::F32(v) => v,
            CpuTensor::Bf16(v) => to_f32(&v),
        }
    }

    /// The same values stored as `dtype`.
    pub fn cast(&self, dtype: Dtype) -> Self {
        match (self, dtype) {
            (CpuTensor::F32(v), Dtype::Bf16) => CpuTensor::Bf16(to_bf16(v)),
            (CpuTensor::Bf16(v), Dtype::F32) => CpuTensor::F32(to_f32(v)),
            (same, _) => same.clone(),
        }
    }

    /// Run `f` on the values in fp32 and store what it leaves in the
    /// tensor's dtype.
    pub fn with_f32<R>(&mut self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        self.with_f32_range(0..self.len(), f)
    }

    /// Elements `range` as [`with_f32`](Self::with_f32) does the whole.
    pub fn with_f32_range<R>(
        &mut self,
        range: std::ops::Range<usize>,
        f: impl FnOnce(&mut [f32]) -> R,
    ) -> R {
        match self {
            CpuTensor::F32(v) => f(&mut v[range]),
            CpuTensor::Bf16(v) => {
                let part = &mut v[range];
                let mut wide = to_f32(part);
                let r = f(&mut wide);
                narrow_into(part, &wide);
                r
            }
        }
    }
}

/// Run `f` on several tensors' values in fp32 at once (fp32 ones moved in
/// and back, no copy), storing each in its dtype afterwards.
pub fn with_f32_all<R>(ts: &mut [CpuTensor], f: impl FnOnce(&mut [Vec<f32>]) -> R) -> R {
    let mut wide: Vec<Vec<f32>> = ts
        .iter_mut()
        .map(|t| match t {
            CpuTensor::F32(v) => std::mem::take(v),
            CpuTensor::Bf16(v) => to_f32(v),
        })
        .collect();
    let r = f(&mut wide);
    for (t, w) in ts.iter_mut().zip(wide) {
        match t {
            CpuTensor::F32(v) => *v = w,
            CpuTensor::Bf16(v) => narrow_into(v, &w),
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_storage_rounds_to_nearest_even_and_widens_exactly() {
        // 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷: ties go to the even 1;
        // 1 + 3·2⁻⁸ halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: to 1 + 2⁻⁶.
        let v = vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5, 1e-3];
        let t = CpuTensor::from_f32(v, Dtype::Bf16);
        assert_eq!((t.dtype(), t.len(), t.bytes()), (Dtype::Bf16, 4, 8));
        let back = t.f32();
        assert_eq!(&back[..3], &[1.0, 1.0 + 4.0 / 256.0, -2.5]);
        assert!((back[3] - 1e-3).abs() < 1e-3 / 128.0);
        assert_eq!(t.cast(Dtype::F32).cast(Dtype::Bf16), t);
    }

    #[test]
    fn a_bf16_output_is_computed_in_fp32_from_its_own_value_and_rounded_once() {
        let mut t = CpuTensor::from_f32(vec![1.0; 2], Dtype::Bf16);
        // Adding 2⁻⁹ a thousand times: in bf16 each add would round away;
        // in fp32 the sum reaches 1 + 1000·2⁻⁹ ≈ 2.95, rounded once.
        t.with_f32(|v| {
            for _ in 0..1000 {
                v.iter_mut().for_each(|x| *x += 1.0 / 512.0);
            }
        });
        assert_eq!(&t.f32()[..], &[2.953125; 2]);
        let mut ts = vec![
            CpuTensor::from(vec![1.0f32]),
            CpuTensor::zeros(1, Dtype::Bf16),
        ];
        with_f32_all(&mut ts, |w| w.iter_mut().for_each(|v| v[0] += 0.1));
        assert_eq!(ts[0], CpuTensor::F32(vec![1.1]));
        assert_eq!(ts[1].f32()[0], bf16::from_f32(0.1).to_f32());
    }
}
