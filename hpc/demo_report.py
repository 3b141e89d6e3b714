#!/usr/bin/env python3
"""The main job's report (hpc/demo.sh): the table, report.json and the plots.

Reads OUT/<config>.json (written by ``train_digits.py --curve``) and
OUT/profile.json; writes OUT/report.json, and OUT/accuracy_vs_time,
OUT/accuracy_vs_step and OUT/layers as PNG and SVG.

Time to accuracy: the target is the dense baseline's (``mpi-dense``) final
test accuracy minus 1 point; a configuration's time to it is the training
wall time (slowest rank, evaluations not counted) at the first evaluation
that reaches it. ``speedup_to_target`` is the baseline's time to the same
target over the configuration's, ``speedup_vs_baseline`` the baseline's
whole wall time (to its final accuracy) over the configuration's time to
the target.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

BASELINE = "mpi-dense"
COLORS = {"mpi-dense": "#444444", "gradsync-dense": "#1f77b4", "auto": "#d62728", "rgc": "#2ca02c"}
# The two dense runs train alike (the same averages up to rounding), so
# their lines lie on each other: the baseline thick, gradsync's dashed.
STYLES = {"mpi-dense": {"lw": 4.0, "alpha": 0.55}, "gradsync-dense": {"lw": 1.6, "ls": "--"}}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def time_to(curve, target):
    for p in curve:
        if p["test_accuracy"] >= target - 1e-9:
            return p["wall_s"]
    return None


def fmt_bytes(b: float) -> str:
    for unit, k in (("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--network", required=True, choices=["1gbit", "shm"])
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--configs", default="mpi-dense gradsync-dense auto rgc")
    ap.add_argument("--command", default="hpc/demo.sh")
    args = ap.parse_args()

    runs = []
    for name in args.configs.split():
        path = os.path.join(args.out, f"{name}.json")
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"demo_report: {path}: {e}", file=sys.stderr)
            return 1
    base = next((r for r in runs if r["name"] == BASELINE), runs[0])
    target = base["test_accuracy"] - 0.01
    base_ttt = time_to(base["curve"], target)
    configs = []
    for r in runs:
        ttt = time_to(r["curve"], target)
        configs.append({
            "name": r["name"],
            "test_accuracy": r["test_accuracy"],
            "wall_s": r["wall_s"],
            "steps": r["steps"],
            "sync_s_per_step": r["sync_s_per_step"],
            "compute_s_per_step": r["compute_s_per_step"],
            "bytes_per_step": r["bytes_per_step"],
            "time_to_target_s": ttt,
            "speedup_to_target": (base_ttt / ttt) if (ttt and base_ttt) else None,
            "speedup_vs_baseline": (base["wall_s"] / ttt) if ttt else None,
            "layers": r["layers"],
            "curve": r["curve"],
        })
    auto = next((c for c in configs if c["name"] == "auto"), None)
    params = sum(layer["elements"] for layer in runs[0]["layers"])
    report = {
        "ranks": args.ranks,
        "network": args.network,
        "command": args.command,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": f"MLP, {params / 1e6:.2f}M parameters in {len(runs[0]['layers'])} layers",
        "parameters": params,
        "baseline": base["name"],
        "target_accuracy": target,
        "configs": configs,
        "auto_layers": [{"name": layer["name"], "elements": layer["elements"], "strategy": layer["strategy"]}
                        for layer in (auto["layers"] if auto else [])],
    }
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)

    # The table.
    print()
    print(f"{args.ranks} ranks, network {args.network}, {report['model']}; "
          f"target: {BASELINE}'s final test accuracy - 1 point = {target * 100:.2f} %")
    head = (f"{'configuration':15s} {'test acc':>8s} {'wall s':>7s} {'steps':>5s} {'compute':>10s} "
            f"{'sync':>10s} {'bytes/step':>11s} {'to target':>9s} {'speedup':>7s}")
    print(head)
    print("-" * len(head))
    for c in configs:
        ttt = "never" if c["time_to_target_s"] is None else f"{c['time_to_target_s']:.1f} s"
        sp = "-" if c["speedup_to_target"] is None else f"{c['speedup_to_target']:.1f}x"
        print(f"{c['name']:15s} {c['test_accuracy'] * 100:7.2f}% {c['wall_s']:7.1f} {c['steps']:5d} "
              f"{c['compute_s_per_step'] * 1e3:7.2f} ms {c['sync_s_per_step'] * 1e3:7.2f} ms "
              f"{fmt_bytes(c['bytes_per_step']):>11s} {ttt:>9s} {sp:>7s}")
    print("(compute and sync: seconds per step, slowest rank; speedup: time to the target against "
          f"{BASELINE}'s)")
    if auto:
        print("\nauto's per-layer choice (bytes per step and rank, every configuration):")
        names = [c["name"] for c in configs]
        print(f"{'layer':12s} {'elements':>9s} {'auto chose':18s} " + " ".join(f"{n:>14s}" for n in names))
        for i, layer in enumerate(auto["layers"]):
            row = " ".join(f"{fmt_bytes(c['layers'][i]['bytes_per_step']):>14s}" for c in configs)
            print(f"{layer['name']:12s} {layer['elements']:9d} {layer['strategy']:18s} {row}")

    plots(args.out, report, configs)
    print(f"\nwrote {args.out}/report.json and {args.out}/{{accuracy_vs_time,accuracy_vs_step,layers}}.{{png,svg}}")
    return 0


def plots(out: str, report, configs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{report['model']}, {report['ranks']} ranks, {report['network']}"
    for xkey, xlabel, fname in (("wall_s", "training wall time (s, slowest rank)", "accuracy_vs_time"),
                                ("step", "step", "accuracy_vs_step")):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for c in configs:
            xs = [p[xkey] for p in c["curve"]]
            ys = [100 * p["test_accuracy"] for p in c["curve"]]
            style = STYLES.get(c["name"], {"lw": 1.8})
            ax.plot(xs, ys, label=c["name"], color=COLORS.get(c["name"]), **style)
        ax.axhline(100 * report["target_accuracy"], color="#888888", ls="--", lw=1,
                   label=f"target ({report['baseline']} final - 1 pt)")
        if xkey == "wall_s":
            ax.set_xscale("log")
        ax.set_ylim(max(0.0, 100 * report["target_accuracy"] - 15), 100)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=9)
        fig.tight_layout()
        for ext in ("png", "svg"):
            fig.savefig(os.path.join(out, f"{fname}.{ext}"), dpi=120)
        plt.close(fig)

    # Per layer: bytes per step and rank of every configuration; the x
    # labels carry auto's choice.
    auto = next((c for c in configs if c["name"] == "auto"), None)
    layers = configs[0]["layers"]
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(layers))]
        ax.bar(xs, [max(layer["bytes_per_step"], 1.0) for layer in c["layers"]], width,
               label=c["name"], color=COLORS.get(c["name"]))
    labels = []
    for i, layer in enumerate(layers):
        lab = f"{layer['name']}\n{layer['elements']:,}"
        if auto:
            lab += f"\nauto: {auto['layers'][i]['strategy']}"
        labels.append(lab)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("bytes sent per step and rank (mean)")
    ax.set_title(f"per-layer strategy and bytes: {title}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(os.path.join(out, f"layers.{ext}"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
