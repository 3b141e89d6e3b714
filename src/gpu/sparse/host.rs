//! [`SparseOps`] on the CPU: the reference the kernels are checked
//! against, element for element, and what the device step's policy and
//! exchange are tested with under `mpirun` where there is no GPU.

use super::{AbsStats, Compacted, SparseOps, MAX_T};
use crate::{Error, Result};

/// The fused gradient, residual and momentum buffers in host memory.
#[derive(Clone, Debug, Default)]
pub struct HostOps {
    sizes: Vec<usize>,
    offsets: Vec<usize>,
    /// The gradients (input), then the step's result.
    pub grads: Vec<f32>,
    /// The residual `V`.
    pub v: Vec<f32>,
    /// The momentum `U`.
    pub u: Vec<f32>,
}

impl HostOps {
    /// Zeroed buffers for layers of `sizes`.
    pub fn new(sizes: &[usize]) -> Self {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut n = 0;
        for &s in sizes {
            offsets.push(n);
            n += s;
        }
        HostOps {
            sizes: sizes.to_vec(),
            offsets,
            grads: vec![0.0; n],
            v: vec![0.0; n],
            u: vec![0.0; n],
        }
    }

    fn layer(&self, l: usize) -> std::ops::Range<usize> {
        self.offsets[l]..self.offsets[l] + self.sizes[l]
    }
}

impl SparseOps for HostOps {
    fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    fn grads_nonfinite(&mut self) -> Result<bool> {
        Ok(!self.grads.iter().all(|g| g.is_finite()))
    }

    fn accumulate(&mut self, m: f32, nesterov: bool) -> Result<()> {
        for i in 0..self.grads.len() {
            let g = self.grads[i];
            let d = if m == 0.0 {
                g
            } else {
                let ui = m * self.u[i] + g;
                self.u[i] = ui;
                if nesterov {
                    g + m * ui
                } else {
                    ui
                }
            };
            self.v[i] += d;
        }
        Ok(())
    }

    fn stats(&mut self) -> Result<Vec<AbsStats>> {
        Ok((0..self.sizes.len())
            .map(|l| {
                let mut s = AbsStats::default();
                for &x in &self.v[self.layer(l)] {
                    let a = x.abs();
                    if !a.is_nan() {
                        s.sum += f64::from(a);
                        s.count += 1;
                        s.max = s.max.max(a);
                    }
                }
                s
            })
            .collect())
    }

    fn count_above(&mut self, thr: &[Vec<f32>]) -> Result<Vec<Vec<u64>>> {
        thr.iter()
            .enumerate()
            .map(|(l, ts)| {
                if ts.len() > MAX_T {
                    return Err(Error::InvalidArgument(format!(
                        "{} thresholds for layer {l}, at most {MAX_T}",
                        ts.len()
                    )));
                }
                let x = &self.v[self.layer(l)];
                Ok(ts
                    .iter()
                    .map(|&t| x.iter().filter(|v| v.abs() > t).count() as u64)
                    .collect())
            })
            .collect()
    }

    fn compact(&mut self, thr: &[f32]) -> Result<Compacted> {
        let mut c = Compacted::default();
        for (l, &t) in thr.iter().enumerate() {
            let r = self.layer(l);
            let before = c.idx.len();
            for (i, &x) in self.v[r].iter().enumerate() {
                if x.abs() > t {
                    c.idx.push(i as u32);
                    c.val.push(x);
                }
            }
            c.counts.push(c.idx.len() - before);
        }
        Ok(c)
    }

    fn clear_sent(&mut self, gidx: &[u64]) -> Result<()> {
        for &i in gidx {
            self.v[i as usize] = 0.0;
            self.u[i as usize] = 0.0;
        }
        Ok(())
    }

    fn clear_layer(&mut self, l: usize) -> Result<()> {
        let r = self.layer(l);
        self.v[r.clone()].fill(0.0);
        self.u[r].fill(0.0);
        Ok(())
    }

    fn scatter(&mut self, ranks: &[(Vec<u64>, Vec<f32>)], scale: f32) -> Result<()> {
        self.grads.fill(0.0);
        for (gi, val) in ranks {
            for (&i, &v) in gi.iter().zip(val) {
                let o = &mut self.grads[i as usize];
                *o += scale * v;
            }
        }
        Ok(())
    }
}
