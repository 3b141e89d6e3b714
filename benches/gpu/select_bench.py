"""Top-0.1 % selection of 2^26 float32 on the GPU, against the peers
measured in the same run (hpc/gpu/check.sh runs it on the device machine):

* the device-to-device copy of the same tensor (torch's ``copy_``), the
  bandwidth a memory-bound selection is measured against (bytes read plus
  bytes written);
* ``torch.topk`` of ``|x|`` with the same k, what PyTorch users would call;
* gradsync's device selection (RedSync's threshold binary search, its
  count passes and its ascending stream compaction) and the device sparse
  step against staging plus the host engine, from
  ``device_sparse_check --bench`` (a Rust example in the bundle), where the
  bundle has it.

Medians of ``--reps`` timed repetitions after warm-ups, CUDA events around
each. Writes one JSON object to ``--out`` and prints a table.

    python3 benches/gpu/select_bench.py --out select_bench.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def timed(torch, fn, reps, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log2n", type=int, default=26)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--example", default=".gpu/bin/device_sparse_check")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("select_bench: SKIPPED: torch sees no CUDA device")
        return 0
    n = 1 << a.log2n
    k = max(1, int(round(a.density * n)))
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(n, device="cuda", generator=g, dtype=torch.float32)
    y = torch.empty_like(x)
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "n": n,
        "k": k,
        "density": a.density,
        "reps": a.reps,
    }
    copy_s, _ = timed(torch, lambda: y.copy_(x), a.reps)
    res["copy_s"] = copy_s
    res["copy_gbps"] = 2 * 4 * n / copy_s / 1e9
    topk_s, _ = timed(torch, lambda: torch.topk(x.abs(), k, sorted=False), a.reps)
    res["torch_topk_s"] = topk_s
    res["torch_topk_gbps"] = 4 * n / topk_s / 1e9
    print(f"select_bench: {res['device']}, n = 2^{a.log2n}, k = {k}")
    print(f"  device-to-device copy: {copy_s * 1e3:8.3f} ms  {res['copy_gbps']:7.1f} GB/s (read + write)")
    print(f"  torch.topk(|x|, k):    {topk_s * 1e3:8.3f} ms  {res['torch_topk_gbps']:7.1f} GB/s (input bytes)")
    if os.path.exists(a.example):
        import shutil
        launcher = ["mpirun", "-np", "1"] if shutil.which("mpirun") else []
        cmd = launcher + [a.example, "--bench", "--log2n", str(a.log2n), "--density", str(a.density),
               "--reps", str(a.reps)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        sys.stdout.write(p.stdout[-4000:])
        sys.stderr.write(p.stderr[-4000:])
        line = [l for l in p.stdout.splitlines() if l.startswith("BENCH-JSON ")]
        if p.returncode != 0 or not line:
            print(f"select_bench: {' '.join(cmd)} failed (exit {p.returncode})")
            res["gradsync_error"] = f"exit {p.returncode}"
        else:
            gs = json.loads(line[-1][len("BENCH-JSON "):])
            res["gradsync"] = gs
            sel = gs.get("select_s")
            if sel:
                gbps = 4 * n / sel / 1e9
                res["gradsync_select_gbps"] = gbps
                res["select_vs_copy"] = gbps / res["copy_gbps"]
                res["speedup_vs_torch_topk"] = topk_s / sel
                print(f"  gradsync selection:    {sel * 1e3:8.3f} ms  {gbps:7.1f} GB/s (input bytes), "
                      f"{res['select_vs_copy']:.2f} of the copy, {res['speedup_vs_torch_topk']:.1f}x torch.topk")
    else:
        print(f"select_bench: no {a.example}: gradsync's device selection not measured")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 1 if "gradsync_error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
