//! The engine on device gradients through host staging (the first form
//! of device support): each layer's device buffer is copied into a host staging
//! slot of its [`DeviceCopies`] (pinned memory on a GPU:
//! [`crate::gpu::CudaStaging`]), the host engine runs the step on the
//! slots ([`GradSync::sync`]: selection, compression, residuals and
//! momentum all on the host), and each layer's update direction is copied
//! back over its device buffer. This is the "copy to the host and run the
//! host engine" path the GPU work is measured against; the residuals and
//! momentum stay on the host here.
//!
//! Failures follow [`crate::comm::agree`]: a copy to the host that fails on one
//! rank fails the step on every rank ([`GradSync::fail_step`]:
//! [`Error::RankFailed`] everywhere, nothing applied, the next step runs);
//! a copy back that fails after the step's collectives cannot be told to
//! the others in that step, and a failed device copy leaves a CUDA context
//! unusable anyway, so the rank ends the job (`MPI_Abort`) naming the layer.

use super::{DeviceStats, GradSync, StepStats};
use crate::comm::Transport;
use crate::gpu::DeviceCopies;
use crate::{Error, Result};

impl<C: Transport + Send + 'static> GradSync<C> {
    /// One synchronous step on device gradients: `layers[i]` is layer `i`'s
    /// gradient buffer (in registration order), replaced by the layer's
    /// update direction, as [`sync`](Self::sync) does with host slices; the
    /// results are the host engine's on the same values, bit for bit.
    /// Collective, like [`sync`](Self::sync).
    ///
    /// ```
    /// use gradsync::comm::LocalComm;
    /// use gradsync::gpu::HostMemory;
    /// use gradsync::sync::{Config, GradSync};
    /// let got = LocalComm::run(3, |c| {
    ///     let mut e = GradSync::with_transport(c, Config::default()).unwrap();
    ///     e.register("w", &[4]).unwrap();
    ///     let r = e.rank() as f32;
    ///     let mut dev = [HostMemory::new(vec![r, 1.0, 2.0, 3.0])];
    ///     e.sync_device(&mut dev).unwrap();
    ///     dev[0].data().to_vec()
    /// });
    /// // The average over 3 ranks (dense: the default strategy).
    /// assert_eq!(got[2], vec![1.0, 1.0, 2.0, 3.0]);
    /// ```
    pub fn sync_device<D: DeviceCopies>(&mut self, layers: &mut [D]) -> Result<&StepStats> {
        // 1. Every layer's copy to the host started (one stream each), then
        //    waited for.
        let t_in = std::time::Instant::now();
        if let Err(e) = stage_in(layers) {
            return Err(self.fail_step(e));
        }
        let to_host_s = t_in.elapsed().as_secs_f64();
        // 2. The host engine on the staging slots.
        let mut grads: Vec<&mut [f32]> = Vec::with_capacity(layers.len());
        let mut bad = None;
        for (i, d) in layers.iter_mut().enumerate() {
            let n = d.len();
            match d.slot(0) {
                Ok(s) if s.len() >= n => grads.push(&mut s[..n]),
                Ok(s) => {
                    bad = Some(Error::Device(format!(
                        "layer {i}: staging slot of {} elements for {n}",
                        s.len()
                    )));
                    break;
                }
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = bad {
            drop(grads);
            return Err(self.fail_step(e));
        }
        self.sync(&mut grads)?;
        drop(grads);
        // 3. The results back over the device buffers.
        let t_out = std::time::Instant::now();
        if let Err((i, e)) = stage_out(layers) {
            let name = self
                .layer(super::LayerId(i))
                .map_or_else(|| format!("{i}"), |(n, ..)| format!("{i} ({n:?})"));
            self.abort_job(&format!(
                "copying step {}'s result of layer {name} back to the device failed: {e}",
                self.step().saturating_sub(1)
            ));
        }
        self.last.device = Some(DeviceStats {
            route: "staged".into(),
            cuda_aware: crate::gpu::cuda_aware().ok().map(|a| a.aware),
            bytes: 4 * layers.iter().map(|d| d.len()).sum::<usize>(),
            to_host_s,
            to_device_s: t_out.elapsed().as_secs_f64(),
        });
        Ok(self.last_stats())
    }
}

#[cfg(test)]
mod tests;

fn stage_in<D: DeviceCopies>(layers: &mut [D]) -> Result<()> {
    let mut fences = Vec::with_capacity(layers.len());
    for d in layers.iter_mut() {
        let n = d.len();
        d.prepare(1, n)?;
        fences.push(d.start_to_host(0..n, 0)?);
    }
    for (d, f) in layers.iter_mut().zip(fences) {
        d.wait(f)?;
    }
    Ok(())
}

/// The copies back; an error names the layer.
fn stage_out<D: DeviceCopies>(layers: &mut [D]) -> std::result::Result<(), (usize, Error)> {
    for (i, d) in layers.iter_mut().enumerate() {
        let n = d.len();
        d.start_to_device(0, 0..n).map_err(|e| (i, e))?;
    }
    for (i, d) in layers.iter_mut().enumerate() {
        d.synchronize().map_err(|e| (i, e))?;
    }
    Ok(())
}
