#!/usr/bin/env python3
"""The table, report.json and plots of hpc/compare_torch.sh.

Reads ``OUT/<config>.json`` (one line each, from examples/python/train_torch.py)
and writes ``OUT/report.json``::

    {"network", "ranks", "command", "target_accuracy", "noop_limit_s",
     "configs": [{"name", "test_accuracy", "wall_s", "time_to_target_s",
                  "speedup_to_target", "sync_s_per_step", "compute_s_per_step",
                  "bytes_per_step", "step_s", "layers"}]}

The target is ``ddp``'s final test accuracy minus 1 point; a configuration's
time to target is its training time (evaluation excluded) at the first
evaluation at or above it; the speedup is ``ddp``'s time to target over its
own. ``compute_s_per_step`` is the median step of ``noop`` (DDP with no
communication), ``sync_s_per_step`` a configuration's median step minus it
(the synchronization the step exposes). ``noop_limit_s`` is the
zero-communication limit: ``noop``'s median step times the steps ``ddp``
needs to reach the target.
"""

import argparse
import json
import os


def first_at(curve, target):
    for step, t, acc in curve:
        if acc >= target:
            return step, t
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--network", required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    runs = {}
    for name in args.configs.split():
        with open(os.path.join(args.out, f"{name}.json")) as f:
            runs[name] = json.loads(f.readline())
    base = runs.get("ddp")
    target = base["test_accuracy"] - 0.01 if base else None
    ddp_step, ddp_ttt = first_at(base["curve"], target) if base else (None, None)
    noop = runs.get("noop")
    compute = noop["step_s"] if noop else None
    rows = []
    for name, r in runs.items():
        step, ttt = first_at(r["curve"], target) if target is not None else (None, None)
        rows.append({
            "name": name,
            "test_accuracy": r["test_accuracy"],
            "wall_s": r["wall_s"],
            "time_to_target_s": ttt,
            "steps_to_target": step,
            "speedup_to_target": (ddp_ttt / ttt) if (ttt and ddp_ttt) else None,
            "sync_s_per_step": max(r["step_s"] - compute, 0.0) if compute is not None else None,
            "compute_s_per_step": compute,
            "bytes_per_step": r["bytes_per_step"],
            "step_s": r["step_s"],
            "replicas_equal": r["replicas_equal"],
            "layers": r.get("layers"),
        })
    limit = compute * ddp_step if (compute is not None and ddp_step) else None
    report = {
        "network": args.network,
        "ranks": args.ranks,
        "command": args.command,
        "target_accuracy": target,
        "noop_limit_s": limit,
        "configs": rows,
    }
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"\n{args.ranks} ranks, network {args.network}; target accuracy {fmt(target, '.4f')} "
          f"(ddp's final minus 1 point); zero-communication limit {fmt(limit, '.2f')} s")
    print(f"{'config':<20}{'test acc':>9}{'wall s':>9}{'to target s':>12}{'speedup':>9}"
          f"{'step ms':>9}{'sync ms':>9}{'MB/step':>9}")
    for r in rows:
        print(f"{r['name']:<20}{r['test_accuracy']:>9.4f}{r['wall_s']:>9.2f}{fmt(r['time_to_target_s'], '.2f'):>12}"
              f"{fmt(r['speedup_to_target'], '.2f'):>9}{1e3 * r['step_s']:>9.1f}"
              f"{fmt(None if r['sync_s_per_step'] is None else 1e3 * r['sync_s_per_step'], '.1f'):>9}"
              f"{r['bytes_per_step'] / 1e6:>9.3f}")
    print(f"report: {os.path.join(args.out, 'report.json')}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for x_key, x_label, fname in [(1, "training time (s)", "accuracy_vs_time"), (0, "step", "accuracy_vs_step")]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, r in runs.items():
            ax.plot([c[x_key] for c in r["curve"]], [c[2] for c in r["curve"]], label=name,
                    linestyle=":" if name == "noop" else "-")
        if target is not None:
            ax.axhline(target, color="grey", linewidth=0.8, linestyle="--", label="target")
        ax.set_xlabel(x_label)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.set_title(f"train_torch.py, {args.ranks} ranks, {args.network}")
        ax.legend()
        fig.tight_layout()
        for ext in ("png", "svg"):
            fig.savefig(os.path.join(args.out, f"{fname}.{ext}"))
        plt.close(fig)


if __name__ == "__main__":
    main()
