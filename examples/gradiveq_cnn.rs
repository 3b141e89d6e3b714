//! GradiVeQ on real convolution gradients: a compact hand-written CNN is
//! trained by SGD on generated images; the gradient of its (3, 3, 16, 16)
//! convolution (the paper's example layer) is dumped every step as a
//! `(steps, 2304)` .npy in GradiVeQ's flattening (filters adjacent, then
//! depth, width, height; `K = 3·16·16 = 768`, three slices). A compressor is
//! fitted on the first `L_t` steps (λ = 0.01, eq. 6) and the eq.-7 loss is
//! measured on every later step.
//!
//! ```text
//! cargo run --release --example gradiveq_cnn -- --steps 400 --lt 100 --out /tmp/conv2_grads.npy
//! hpc/mpirun.sh -np 2 target/release/gradsync bench --op gradiveq --data /tmp/conv2_grads.npy --k 768 --check
//! ```
//!
//! The net: 1×16×16 input → conv 3×3, 16 filters → ReLU → conv 3×3,
//! 16 → 16 → ReLU → global average pool → linear 16 → 4 → softmax. The
//! images are noisy oriented stripes (four classes: horizontal, vertical and
//! the two diagonals) at random phases.

#![allow(clippy::needless_range_loop)] // textbook index loops over small tensors

use gradsync::gradiveq::{flatten_conv_from_fdhw, Compressor, Dim};
use ndarray::Array2;
use rand::{rngs::SmallRng, Rng, SeedableRng};

const S: usize = 16; // image side
const C1: usize = 16;
const C2: usize = 16;
const CLASSES: usize = 4;
const BATCH: usize = 16;

struct Conv {
    f: usize,
    d: usize,
    w: Vec<f32>, // (F, D, 3, 3)
    b: Vec<f32>,
}

impl Conv {
    fn new(f: usize, d: usize, r: &mut SmallRng) -> Self {
        let s = (2.0 / (9 * d) as f32).sqrt();
        Conv {
            f,
            d,
            w: (0..f * d * 9).map(|_| r.gen_range(-s..s)).collect(),
            b: vec![0.0; f],
        }
    }
    /// Same-padding 3×3 convolution of a (D, S, S) input.
    fn forward(&self, x: &[f32], y: &mut [f32]) {
        for f in 0..self.f {
            for i in 0..S {
                for j in 0..S {
                    let mut acc = self.b[f];
                    for d in 0..self.d {
                        for u in 0..3 {
                            let ii = i + u;
                            if !(1..=S).contains(&ii) {
                                continue;
                            }
                            for v in 0..3 {
                                let jj = j + v;
                                if !(1..=S).contains(&jj) {
                                    continue;
                                }
                                acc += self.w[((f * self.d + d) * 3 + u) * 3 + v]
                                    * x[(d * S + ii - 1) * S + jj - 1];
                            }
                        }
                    }
                    y[(f * S + i) * S + j] = acc;
                }
            }
        }
    }
    /// Accumulate dW, db; write dx (if given).
    fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        dw: &mut [f32],
        db: &mut [f32],
        mut dx: Option<&mut [f32]>,
    ) {
        if let Some(dx) = dx.as_deref_mut() {
            dx.fill(0.0);
        }
        for f in 0..self.f {
            for i in 0..S {
                for j in 0..S {
                    let g = dy[(f * S + i) * S + j];
                    if g == 0.0 {
                        continue;
                    }
                    db[f] += g;
                    for d in 0..self.d {
                        for u in 0..3 {
                            let ii = i + u;
                            if !(1..=S).contains(&ii) {
                                continue;
                            }
                            for v in 0..3 {
                                let jj = j + v;
                                if !(1..=S).contains(&jj) {
                                    continue;
                                }
                                let wi = ((f * self.d + d) * 3 + u) * 3 + v;
                                let xi = (d * S + ii - 1) * S + jj - 1;
                                dw[wi] += g * x[xi];
                                if let Some(dx) = dx.as_deref_mut() {
                                    dx[xi] += g * self.w[wi];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn image(r: &mut SmallRng) -> (Vec<f32>, usize) {
    let class = r.gen_range(0..CLASSES);
    let phase = r.gen_range(0.0..std::f32::consts::TAU);
    let freq = r.gen_range(0.6f32..1.2);
    let mut x = vec![0f32; S * S];
    for i in 0..S {
        for j in 0..S {
            let t = match class {
                0 => i as f32,
                1 => j as f32,
                2 => (i + j) as f32 * 0.7,
                _ => (i as f32 - j as f32) * 0.7,
            };
            x[i * S + j] = (freq * t + phase).sin() + 0.3 * r.gen_range(-1.0f32..1.0);
        }
    }
    (x, class)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |k: &str, d: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| d.to_string())
    };
    let steps: usize = opt("--steps", "400").parse()?;
    let lt: usize = opt("--lt", "100").parse()?;
    let lambda: f64 = opt("--lambda", "0.01").parse()?;
    let lr: f32 = opt("--lr", "0.05").parse()?;
    let out_path = opt("--out", "");
    if steps <= lt || lt < 2 {
        return Err("need --steps > --lt ≥ 2".into());
    }
    let mut r = SmallRng::seed_from_u64(42);
    let mut c1 = Conv::new(C1, 1, &mut r);
    let mut c2 = Conv::new(C2, C1, &mut r);
    let s = (1.0 / C2 as f32).sqrt();
    let mut fc: Vec<f32> = (0..CLASSES * C2).map(|_| r.gen_range(-s..s)).collect();
    let mut fcb = [0f32; CLASSES];
    let n2 = C2 * C1 * 9;
    let mut dumps = Array2::<f32>::zeros((steps, n2));
    let (mut h1, mut h2) = (vec![0f32; C1 * S * S], vec![0f32; C2 * S * S]);
    let (mut dh1, mut dh2) = (vec![0f32; C1 * S * S], vec![0f32; C2 * S * S]);
    let mut flat = Vec::new();
    let mut losses = Vec::new();
    for step in 0..steps {
        let (mut dw1, mut db1) = (vec![0f32; c1.w.len()], vec![0f32; C1]);
        let (mut dw2, mut db2) = (vec![0f32; n2], vec![0f32; C2]);
        let (mut dfc, mut dfcb) = (vec![0f32; fc.len()], vec![0f32; CLASSES]);
        let mut loss = 0f32;
        for _ in 0..BATCH {
            let (x, y) = image(&mut r);
            c1.forward(&x, &mut h1);
            h1.iter_mut().for_each(|v| *v = v.max(0.0));
            c2.forward(&h1, &mut h2);
            h2.iter_mut().for_each(|v| *v = v.max(0.0));
            let pooled: Vec<f32> = (0..C2)
                .map(|f| h2[f * S * S..(f + 1) * S * S].iter().sum::<f32>() / (S * S) as f32)
                .collect();
            let mut z: Vec<f32> = (0..CLASSES)
                .map(|c| fcb[c] + (0..C2).map(|f| fc[c * C2 + f] * pooled[f]).sum::<f32>())
                .collect();
            let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|v| (v - m).exp()).sum();
            z.iter_mut().for_each(|v| *v = (*v - m).exp() / sum);
            loss -= z[y].max(1e-30).ln();
            z[y] -= 1.0;
            let inv = 1.0 / BATCH as f32;
            let mut dpool = [0f32; C2];
            for c in 0..CLASSES {
                let dz = z[c] * inv;
                dfcb[c] += dz;
                for f in 0..C2 {
                    dfc[c * C2 + f] += dz * pooled[f];
                    dpool[f] += dz * fc[c * C2 + f];
                }
            }
            for f in 0..C2 {
                for q in 0..S * S {
                    let i = f * S * S + q;
                    dh2[i] = if h2[i] > 0.0 {
                        dpool[f] / (S * S) as f32
                    } else {
                        0.0
                    };
                }
            }
            c2.backward(&h1, &dh2, &mut dw2, &mut db2, Some(&mut dh1));
            for (d, h) in dh1.iter_mut().zip(&h1) {
                if *h <= 0.0 {
                    *d = 0.0;
                }
            }
            c1.backward(&x, &dh1, &mut dw1, &mut db1, None);
        }
        losses.push(loss / BATCH as f32);
        // Dump conv2's gradient in GradiVeQ's flattening: (F, D, H, W) → (H, W, D, F).
        flatten_conv_from_fdhw(&dw2, [C2, C1, 3, 3], &mut flat)?;
        dumps
            .row_mut(step)
            .assign(&ndarray::ArrayView1::from(&flat[..]));
        for (w, g) in c1.w.iter_mut().zip(&dw1) {
            *w -= lr * g;
        }
        for (w, g) in c1.b.iter_mut().zip(&db1) {
            *w -= lr * g;
        }
        for (w, g) in c2.w.iter_mut().zip(&dw2) {
            *w -= lr * g;
        }
        for (w, g) in c2.b.iter_mut().zip(&db2) {
            *w -= lr * g;
        }
        for (w, g) in fc.iter_mut().zip(&dfc) {
            *w -= lr * g;
        }
        for (w, g) in fcb.iter_mut().zip(&dfcb) {
            *w -= lr * g;
        }
    }
    if !out_path.is_empty() {
        ndarray_npy::write_npy(&out_path, &dumps)?;
    }
    // GradiVeQ on the dumped gradients: K = 3·16·16 = 768, three slices,
    // one compressor (s = ∞) fitted on the first slice of the first L_t steps.
    let k = 3 * C1 * C2;
    let rows: Vec<Vec<f32>> = (0..steps).map(|t| dumps.row(t).to_vec()).collect();
    let samples: Vec<&[f32]> = rows[..lt].iter().map(|r| &r[..k]).collect();
    let comp = Compressor::fit(&samples, Dim::Lambda(lambda))?;
    let d = comp.d();
    // Eq. 7 (N = 1, relative to ‖g‖²) on the later steps, every slice.
    let (mut z, mut y) = (vec![0f32; d], vec![0f32; k]);
    let mut eq7 = Vec::new();
    for row in &rows[lt..] {
        let (mut num, mut den) = (0f64, 0f64);
        for slice in row.chunks_exact(k) {
            comp.compress(slice, 1, &mut z);
            comp.decompress(&z, &mut y);
            for (a, b) in slice.iter().zip(&y) {
                num += f64::from(a - b).powi(2);
                den += f64::from(*a).powi(2);
            }
        }
        eq7.push(num / den.max(1e-300));
    }
    eq7.sort_by(f64::total_cmp);
    let mean = eq7.iter().sum::<f64>() / eq7.len() as f64;
    println!(
        "{{\"layer\":\"conv2 (3,3,16,16)\",\"k\":{k},\"lt\":{lt},\"lambda\":{lambda},\"d\":{d},\"ratio\":{:.3},\"retained_energy_on_samples\":{:.4},\"eq7_loss_mean\":{mean:.4},\"eq7_loss_median\":{:.4},\"eq7_loss_p90\":{:.4},\"eval_steps\":{},\"train_loss_first\":{:.4},\"train_loss_last\":{:.4}}}",
        k as f64 / d as f64,
        comp.retained_energy(),
        eq7[eq7.len() / 2],
        eq7[eq7.len() * 9 / 10],
        eq7.len(),
        losses[..10].iter().sum::<f32>() / 10.0,
        losses[steps - 10..].iter().sum::<f32>() / 10.0
    );
    Ok(())
}
