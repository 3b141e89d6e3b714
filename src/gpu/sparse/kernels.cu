// gradsync's device sparse path: RedSync §5.2 on the GPU (what runs on
// the device, all of it; the host side is src/gpu/sparse/cuda.rs, the
// same operations on the CPU src/gpu/sparse/host.rs).
//
// Compiled at run time by NVRTC with --fmad=false: every `a * b + c`
// below is a multiply and an add, rounded twice, as the host engine's
// Rust computes it, so the two paths agree bit for bit.
//
// The layers' buffers are one fused array; a launch covers every layer at
// once. Block b handles elements [blk_start[b], min(blk_start[b] + CHUNK,
// seg_end[blk_seg[b]])) of layer blk_seg[b]; a layer's blocks are
// consecutive.

#define THREADS 256
#define CHUNK 4096
#define MAX_T 31

typedef unsigned long long u64;
typedef unsigned int u32;

// Error feedback with momentum correction (RedSync, after DGC):
// U = m U + g; d = U (Nesterov: g + m U); V += d. No momentum: V += g.
// The same pass takes |V|'s block statistics, as gs_abs_stats does, so
// the selection needs no pass of its own for them.
__device__ __forceinline__ void block_stats(double sum, u32 cnt, float mx, u32 s, double* part_sum,
                                            u32* part_cnt, u32* seg_max) {
  __shared__ double ssum[THREADS];
  __shared__ u32 scnt[THREADS];
  __shared__ float smax[THREADS];
  ssum[threadIdx.x] = sum;
  scnt[threadIdx.x] = cnt;
  smax[threadIdx.x] = mx;
  __syncthreads();
  for (int w = THREADS / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      ssum[threadIdx.x] += ssum[threadIdx.x + w];
      scnt[threadIdx.x] += scnt[threadIdx.x + w];
      smax[threadIdx.x] = fmaxf(smax[threadIdx.x], smax[threadIdx.x + w]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    part_sum[blockIdx.x] = ssum[0];
    part_cnt[blockIdx.x] = scnt[0];
    atomicMax(&seg_max[s], __float_as_uint(smax[0]));
  }
}

// flag[0] = 1 when some g[i] is NaN or infinite.
extern "C" __global__ void gs_nonfinite(const float* __restrict__ g, u64 n, u32* flag) {
  u32 bad = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n;
       i += (u64)gridDim.x * blockDim.x) {
    bad |= isfinite(g[i]) ? 0u : 1u;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1u);
}

__device__ __forceinline__ void chunk_of(const u32* blk_seg, const u64* blk_start,
                                         const u64* seg_end, u32* s, u64* lo, u64* hi) {
  *s = blk_seg[blockIdx.x];
  *lo = blk_start[blockIdx.x];
  u64 e = *lo + CHUNK;
  u64 se = seg_end[*s];
  *hi = e < se ? e : se;
}

// Per block: the sum of |x| (double, a fixed tree order), the non-NaN
// count, and the maximum of |x| into the layer's seg_max (as bits: for
// non-negative floats their order is the integers').
extern "C" __global__ void gs_abs_stats(const float* __restrict__ x, const u32* blk_seg,
                                        const u64* blk_start, const u64* seg_end,
                                        double* part_sum, u32* part_cnt, u32* seg_max) {
  u32 s;
  u64 lo, hi;
  chunk_of(blk_seg, blk_start, seg_end, &s, &lo, &hi);
  double sum = 0.0;
  u32 cnt = 0;
  float mx = 0.0f;
  for (u64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    float a = fabsf(x[i]);
    if (!isnan(a)) {
      sum += (double)a;
      cnt += 1;
      mx = fmaxf(mx, a);
    }
  }
  block_stats(sum, cnt, mx, s, part_sum, part_cnt, seg_max);
}

// gs_abs_stats of the V this writes.
extern "C" __global__ void gs_accumulate_stats(const float* __restrict__ g, float* __restrict__ v,
                                               float* __restrict__ u, float m, int nesterov,
                                               const u32* blk_seg, const u64* blk_start,
                                               const u64* seg_end, double* part_sum,
                                               u32* part_cnt, u32* seg_max) {
  u32 s;
  u64 lo, hi;
  chunk_of(blk_seg, blk_start, seg_end, &s, &lo, &hi);
  double sum = 0.0;
  u32 cnt = 0;
  float mx = 0.0f;
  for (u64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    float gi = g[i];
    float d = gi;
    if (m != 0.0f) {
      float ui = m * u[i] + gi;
      u[i] = ui;
      d = nesterov ? gi + m * ui : ui;
    }
    float vi = v[i] + d;
    v[i] = vi;
    float a = fabsf(vi);
    if (!isnan(a)) {
      sum += (double)a;
      cnt += 1;
      mx = fmaxf(mx, a);
    }
  }
  block_stats(sum, cnt, mx, s, part_sum, part_cnt, seg_max);
}

// One block per layer: its blocks' partial sums and counts, in a fixed
// order (deterministic), with the layer's maximum: out[3 s ..] = (the sum
// as bits, the count, the maximum as bits), read back in one copy.
extern "C" __global__ void gs_seg_sum(const double* part_sum, const u32* part_cnt,
                                      const u32* seg_first_blk, const u32* seg_nblk,
                                      const u32* seg_max, u64* out) {
  __shared__ double ssum[THREADS];
  __shared__ u64 scnt[THREADS];
  u32 s = blockIdx.x;
  u32 first = seg_first_blk[s], nb = seg_nblk[s];
  double sum = 0.0;
  u64 cnt = 0;
  for (u32 j = threadIdx.x; j < nb; j += THREADS) {
    sum += part_sum[first + j];
    cnt += part_cnt[first + j];
  }
  ssum[threadIdx.x] = sum;
  scnt[threadIdx.x] = cnt;
  __syncthreads();
  for (int w = THREADS / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      ssum[threadIdx.x] += ssum[threadIdx.x + w];
      scnt[threadIdx.x] += scnt[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[3 * s] = (u64)__double_as_longlong(ssum[0]);
    out[3 * s + 1] = scnt[0];
    out[3 * s + 2] = seg_max[s];
  }
}

// After gs_scan_blocks: each layer's start in the compacted output (one
// thread; layers are few).
extern "C" __global__ void gs_seg_offsets(const u64* seg_total, u32 nseg, u64* seg_out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    u64 run = 0;
    for (u32 s = 0; s < nseg; s++) {
      seg_out[s] = run;
      run += seg_total[s];
    }
  }
}

// Counts above up to MAX_T thresholds per layer in one pass. thr[s * T ..
// s * T + nthr[s]] are layer s's thresholds, ascending (none NaN).
// hist[s * (MAX_T + 1) + b] counts the elements with exactly b of the
// thresholds strictly below |x|; |x| > thr[j] exactly when b >= j + 1.
extern "C" __global__ void gs_count_multi(const float* __restrict__ x, const u32* blk_seg,
                                          const u64* blk_start, const u64* seg_end,
                                          const float* thr, const u32* nthr, u64* hist) {
  __shared__ float t[MAX_T];
  __shared__ u32 h[MAX_T + 1];
  u32 s;
  u64 lo, hi;
  chunk_of(blk_seg, blk_start, seg_end, &s, &lo, &hi);
  int nt = (int)nthr[s];
  if (threadIdx.x < MAX_T) t[threadIdx.x] = threadIdx.x < nt ? thr[s * MAX_T + threadIdx.x] : 0.0f;
  if (threadIdx.x <= MAX_T) h[threadIdx.x] = 0;
  __syncthreads();
  if (nt > 0) {
    for (u64 i = lo + threadIdx.x; i < hi; i += THREADS) {
      float a = fabsf(x[i]);
      if (!(a > t[0])) continue;  // below every threshold, or NaN
      // b = #{j : t[j] < a}, at least 1 here.
      int l = 1, r = nt;  // answer in [l, r]
      while (l < r) {
        int mid = (l + r + 1) >> 1;
        if (t[mid - 1] < a) l = mid; else r = mid - 1;
      }
      atomicAdd(&h[l], 1u);
    }
  }
  __syncthreads();
  if (threadIdx.x <= MAX_T && h[threadIdx.x] != 0)
    atomicAdd(&hist[s * (MAX_T + 1) + threadIdx.x], (u64)h[threadIdx.x]);
}

// Compaction, pass 1: each block's count of |x| > thr1[layer].
extern "C" __global__ void gs_count_above(const float* __restrict__ x, const u32* blk_seg,
                                          const u64* blk_start, const u64* seg_end,
                                          const float* thr1, u32* blk_cnt) {
  u32 s;
  u64 lo, hi;
  chunk_of(blk_seg, blk_start, seg_end, &s, &lo, &hi);
  float t = thr1[s];
  if (isinf(t) && t > 0.0f) {  // this layer takes nothing in this pass
    if (threadIdx.x == 0) blk_cnt[blockIdx.x] = 0;
    return;
  }
  u32 c = 0;
  for (u64 i = lo + threadIdx.x; i < hi; i += THREADS) c += fabsf(x[i]) > t ? 1u : 0u;
  __shared__ u32 sc[THREADS];
  sc[threadIdx.x] = c;
  __syncthreads();
  for (int w = THREADS / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sc[threadIdx.x] += sc[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) blk_cnt[blockIdx.x] = sc[0];
}

// Compaction, pass 2, one block per layer: the exclusive prefix sums of
// its blocks' counts (blk_off) and its total (seg_total).
extern "C" __global__ void gs_scan_blocks(const u32* blk_cnt, const u32* seg_first_blk,
                                          const u32* seg_nblk, u64* blk_off, u64* seg_total) {
  __shared__ u64 part[THREADS];
  u32 s = blockIdx.x;
  u32 first = seg_first_blk[s], nb = seg_nblk[s];
  u32 per = (nb + THREADS - 1) / THREADS;
  u32 a = threadIdx.x * per;
  u32 b = a + per < nb ? a + per : nb;
  u64 mine = 0;
  for (u32 j = a; j < b; j++) mine += blk_cnt[first + j];
  part[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 run = 0;
    for (int j = 0; j < THREADS; j++) {
      u64 c = part[j];
      part[j] = run;
      run += c;
    }
    seg_total[s] = run;
  }
  __syncthreads();
  u64 run = part[threadIdx.x];
  for (u32 j = a; j < b; j++) {
    blk_off[first + j] = run;
    run += blk_cnt[first + j];
  }
}

// Compaction, pass 3: the elements with |x| > thr1[layer], in ascending
// order, to out_idx (the index inside the layer) and out_val (x itself)
// from seg_out[layer] + blk_off[block]. Tiles of THREADS elements: a
// ballot per warp, the warps' prefix, then the tile's writes.
extern "C" __global__ void gs_compact(const float* __restrict__ x, const u32* blk_seg,
                                      const u64* blk_start, const u64* seg_end,
                                      const u64* seg_begin, const float* thr1, const u64* blk_off,
                                      const u64* seg_out, u32* out_idx, float* out_val,
                                      u64 cap) {
  __shared__ u32 warp_cnt[THREADS / 32];
  __shared__ u64 base;
  u32 s;
  u64 lo, hi;
  chunk_of(blk_seg, blk_start, seg_end, &s, &lo, &hi);
  float t = thr1[s];
  if (isinf(t) && t > 0.0f) return;  // nothing to write for this layer
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) base = seg_out[s] + blk_off[blockIdx.x];
  __syncthreads();
  for (u64 tile = lo; tile < hi; tile += THREADS) {
    u64 i = tile + threadIdx.x;
    float xi = i < hi ? x[i] : 0.0f;
    bool keep = i < hi && fabsf(xi) > t;
    u32 ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_cnt[warp] = __popc(ballot);
    __syncthreads();
    u64 off = base;
    for (int w = 0; w < warp; w++) off += warp_cnt[w];
    off += __popc(ballot & ((1u << lane) - 1u));
    if (keep && off < cap) {
      out_idx[off] = (u32)(i - seg_begin[s]);
      out_val[off] = xi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 tot = 0;
      for (int w = 0; w < THREADS / 32; w++) tot += warp_cnt[w];
      base += tot;
    }
    __syncthreads();
  }
}

// What was sent leaves the residual (V -= sent: exactly 0 for the values
// sent, which are V's own) and its momentum (momentum factor masking).
extern "C" __global__ void gs_clear_sent(float* v, float* u, const u64* gidx, u64 n) {
  u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x;
  if (j < n) {
    u64 i = gidx[j];
    v[i] = 0.0f;
    u[i] = 0.0f;
  }
}

// One rank's entries added into the result: out[i] += scale * val. The
// indices of one rank are distinct, so no two threads touch one element;
// ranks are added one launch after another, in rank order, as the host
// engine does.
extern "C" __global__ void gs_scatter_add(float* out, const u64* gidx, const float* val, u64 n,
                                          float scale) {
  u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x;
  if (j < n) {
    u64 i = gidx[j];
    out[i] = out[i] + scale * val[j];
  }
}
