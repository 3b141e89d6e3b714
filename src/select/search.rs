//! Threshold binary search with threshold reuse: RedSync (Fang et al.)
//! §5.2.2, Algorithm 3 (the ratio search, corrected as in the parent
//! module's docs), Algorithm 5 (reuse for `interval` calls) and the
//! "sampled threshold binary search" estimate.

use super::*;
/// Where the threshold of a [`ThresholdSearch`] call came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThresholdSource {
    /// Nothing to search: `k = 0` (nothing selected) or `k ≥ m` (every
    /// non-NaN element selected). The reuse state is left alone.
    Trivial,
    /// The stored threshold of an earlier search; it passed at most `2k`
    /// elements (else the call searches again).
    Reused,
    /// Estimated from a strided sample, count confirmed in `[k, 2k]`.
    Sampled,
    /// Found by the ratio binary search (count in `[k, 2k]`, or above `2k`
    /// when it stopped on `ε`).
    Searched,
    /// The search stopped on `ε` with fewer than `k` above; the exact top-k
    /// was returned and `threshold` is just below its `k`-th magnitude.
    ExactFallback,
}

/// Result of a [`ThresholdSearch`] call: selected are the `|x_i| > threshold`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThresholdOutcome {
    /// The threshold used (`+∞` selects nothing, negative every non-NaN).
    pub threshold: f32,
    /// How it was obtained.
    pub source: ThresholdSource,
}

/// Threshold binary search selection with threshold reuse (§5.2.2,
/// Algorithm 3; Algorithm 5's `interval`). Keep one per layer: the reused
/// threshold belongs to the tensor it was found on.
#[derive(Clone, Debug)]
pub struct ThresholdSearch {
    eps: f64,
    interval: u32,
    sample_fraction: f64,
    threshold: Option<f32>,
    reuse_left: u32,
    len: usize,
    k: usize,
    searches: u64,
    sample: Vec<f32>,
}

impl Default for ThresholdSearch {
    fn default() -> Self {
        ThresholdSearch {
            eps: DEFAULT_SEARCH_EPS,
            interval: DEFAULT_INTERVAL,
            sample_fraction: DEFAULT_SAMPLE_FRACTION,
            threshold: None,
            reuse_left: 0,
            len: 0,
            k: 0,
            searches: 0,
            sample: Vec::new(),
        }
    }
}

impl ThresholdSearch {
    /// Defaults: `ε` = [`DEFAULT_SEARCH_EPS`], reuse interval
    /// [`DEFAULT_INTERVAL`], sample fraction [`DEFAULT_SAMPLE_FRACTION`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Reuse each found threshold for the next `interval` calls (0: search
    /// every call).
    pub fn with_interval(mut self, interval: u32) -> Self {
        self.interval = interval;
        self
    }

    /// Termination width of the ratio search, in `(0, 1)`.
    pub fn with_eps(mut self, eps: f64) -> Result<Self> {
        if !(eps > 0.0 && eps < 1.0) {
            return Err(Error::InvalidArgument(format!(
                "threshold search eps {eps} must lie in (0, 1)"
            )));
        }
        self.eps = eps;
        Ok(self)
    }

    /// Fraction of elements the sampled variant looks at, in `(0, 1]`.
    pub fn with_sample_fraction(mut self, fraction: f64) -> Result<Self> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "sample fraction {fraction} must lie in (0, 1]"
            )));
        }
        self.sample_fraction = fraction;
        Ok(self)
    }

    /// The stored threshold, if any.
    pub fn threshold(&self) -> Option<f32> {
        self.threshold
    }

    /// Number of thresholds computed so far (searches, samples, fallbacks),
    /// i.e. calls that did not reuse.
    pub fn searches(&self) -> u64 {
        self.searches
    }

    /// Length of [`export_state`](Self::export_state)'s record.
    pub const STATE_LEN: usize = 29;

    /// The reuse state (stored threshold, calls left, the tensor length and
    /// `k` it was found for, search count) as a fixed little-endian record,
    /// so a restored search continues exactly where it stopped.
    pub fn export_state(&self) -> [u8; Self::STATE_LEN] {
        let mut b = [0u8; Self::STATE_LEN];
        b[0] = u8::from(self.threshold.is_some());
        b[1..5].copy_from_slice(&self.threshold.unwrap_or(0.0).to_le_bytes());
        b[5..9].copy_from_slice(&self.reuse_left.to_le_bytes());
        b[9..17].copy_from_slice(&(self.len as u64).to_le_bytes());
        b[17..25].copy_from_slice(&(self.k as u64).to_le_bytes());
        b[25..29].copy_from_slice(&(self.searches as u32).to_le_bytes());
        b
    }

    /// Restore a record from [`export_state`](Self::export_state). Any bytes
    /// are safe: a nonsense record only makes the next call search.
    pub fn import_state(&mut self, b: &[u8; Self::STATE_LEN]) {
        let f = |r: std::ops::Range<usize>| -> [u8; 4] { b[r].try_into().expect("4 bytes") };
        let g = |r: std::ops::Range<usize>| -> [u8; 8] { b[r].try_into().expect("8 bytes") };
        let t = f32::from_le_bytes(f(1..5));
        self.threshold = (b[0] == 1 && !t.is_nan()).then_some(t);
        self.reuse_left = u32::from_le_bytes(f(5..9)).min(self.interval);
        self.len = usize::try_from(u64::from_le_bytes(g(9..17))).unwrap_or(usize::MAX);
        self.k = usize::try_from(u64::from_le_bytes(g(17..25))).unwrap_or(usize::MAX);
        self.searches = u64::from(u32::from_le_bytes(f(25..29)));
    }

    /// Forget the stored threshold; the next call searches.
    pub fn reset(&mut self) {
        self.threshold = None;
        self.reuse_left = 0;
    }

    /// Select by binary search of the threshold, or reuse the stored one.
    pub fn select(
        &mut self,
        x: &[f32],
        k: usize,
        idx_out: &mut Vec<u32>,
        val_out: &mut Vec<f32>,
    ) -> Result<ThresholdOutcome> {
        self.run(x, k, false, idx_out, val_out)
    }

    /// Like [`select`](Self::select), but first estimate the threshold on a
    /// strided sample (every `round(1/fraction)`-th element): the sample's
    /// `ceil(1.5·k·s/m)`-th largest magnitude (`s` sampled, aiming at the
    /// middle of `[k, 2k]`). If the full count above it is outside `[k, 2k]`,
    /// fall back to the binary search.
    pub fn select_sampled(
        &mut self,
        x: &[f32],
        k: usize,
        idx_out: &mut Vec<u32>,
        val_out: &mut Vec<f32>,
    ) -> Result<ThresholdOutcome> {
        self.run(x, k, true, idx_out, val_out)
    }

    fn run(
        &mut self,
        x: &[f32],
        k: usize,
        sampled: bool,
        idx_out: &mut Vec<u32>,
        val_out: &mut Vec<f32>,
    ) -> Result<ThresholdOutcome> {
        check_len(x)?;
        idx_out.clear();
        val_out.clear();
        if k == 0 || x.is_empty() {
            return Ok(ThresholdOutcome {
                threshold: f32::INFINITY,
                source: ThresholdSource::Trivial,
            });
        }
        if let Some(t) = self.threshold {
            if self.reuse_left > 0 && self.len == x.len() && self.k == k {
                self.reuse_left -= 1;
                filter_above(x, t, idx_out);
                // A stale threshold on a grown residual can pass far more
                // than 2k elements (measured: 3M of 16M at k = 16k when the
                // same gradient repeats); then search again instead.
                if idx_out.len() <= k.saturating_mul(2) {
                    gather(x, idx_out, val_out);
                    return Ok(ThresholdOutcome {
                        threshold: t,
                        source: ThresholdSource::Reused,
                    });
                }
                self.reset();
            }
        }
        let (mean, max, m) = abs_stats(x);
        if k >= m {
            exact_topk(x, k, idx_out, val_out)?;
            return Ok(ThresholdOutcome {
                threshold: next_down(0.0),
                source: ThresholdSource::Trivial,
            });
        }
        let hi = k.saturating_mul(2);
        let mut found = None;
        if sampled {
            if let Some(t) = self.estimate(x, k, m) {
                let nnz = count_above(x, t);
                if (k..=hi).contains(&nnz) {
                    found = Some((t, ThresholdSource::Sampled));
                }
            }
        }
        if found.is_none() {
            found = self
                .binary_search(x, k, mean, max)
                .map(|t| (t, ThresholdSource::Searched));
        }
        let (t, source) = match found {
            Some(f) => {
                filter_above(x, f.0, idx_out);
                f
            }
            None => {
                exact_topk(x, k, idx_out, val_out)?;
                let kth = idx_out
                    .iter()
                    .map(|&i| x[i as usize].abs())
                    .fold(f32::INFINITY, f32::min);
                (next_down(kth), ThresholdSource::ExactFallback)
            }
        };
        gather(x, idx_out, val_out);
        self.threshold = Some(t);
        self.reuse_left = self.interval;
        self.len = x.len();
        self.k = k;
        self.searches += 1;
        Ok(ThresholdOutcome {
            threshold: t,
            source,
        })
    }

    /// Algorithm 3, bisecting the ratio (not, as printed, the threshold): a
    /// threshold with count in `[k, 2k]`, or with count above `2k` when the
    /// interval shrank below `ε`; `None` when the last probe had fewer than `k`.
    fn binary_search(&self, x: &[f32], k: usize, mean: f64, max: f64) -> Option<f32> {
        let hi = k.saturating_mul(2);
        let (mut l, mut r) = (0f64, 1f64);
        let mut last = None;
        // 64 halvings exhaust f64; the cap only guards against eps misuse.
        for _ in 0..64 {
            if r - l <= self.eps {
                break;
            }
            let ratio = l + (r - l) / 2.0;
            let t = threshold_at(mean, max, ratio);
            let nnz = count_above(x, t);
            last = Some((t, nnz));
            if (k..=hi).contains(&nnz) {
                return Some(t);
            } else if nnz < k {
                r = ratio;
            } else {
                l = ratio;
            }
        }
        match last {
            Some((t, nnz)) if nnz >= k => Some(t),
            _ => None,
        }
    }

    /// The sampled threshold estimate, or `None` when the sample is too small.
    fn estimate(&mut self, x: &[f32], k: usize, m: usize) -> Option<f32> {
        let stride = ((1.0 / self.sample_fraction).round() as usize).max(1);
        self.sample.clear();
        self.sample.extend(
            x.iter()
                .step_by(stride)
                .map(|v| v.abs())
                .filter(|a| !a.is_nan()),
        );
        let s = self.sample.len();
        let target = ((1.5 * k as f64 * s as f64 / m as f64).ceil() as usize).max(1);
        if target >= s {
            return None;
        }
        let (_, kth, _) = self
            .sample
            .select_nth_unstable_by(target - 1, |a, b| b.total_cmp(a));
        Some(next_down(*kth))
    }
}
