#!/usr/bin/python3
"""plot_metrics: draws loss curves from trainer metrics files (JSONL) into one PNG.

    scripts/plot_metrics.py out/demo/metrics.jsonl [more.jsonl ...] -o loss.png [--lr] [--title T]

Each file is one run (labelled by its file name, or by --labels). Train loss is drawn as a thin
line, eval loss as markers on the same colour; with --lr a second panel shows the learning rate.
Reads only the records the trainer writes: {"plan": ...} first, then {"step", "loss", "lr", ...}
per optimizer step and {"step", "eval_loss"} per eval. Uses matplotlib's Agg backend (no display).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    train, evals, lr = [], [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_metrics: {path}:{n}: not JSON: {e}")
            if "eval_loss" in rec:
                evals.append((rec["step"], rec["eval_loss"]))
            elif "loss" in rec:
                train.append((rec["step"], rec["loss"]))
                if "lr" in rec:
                    lr.append((rec["step"], rec["lr"]))
    return train, evals, lr


def main():
    ap = argparse.ArgumentParser(description="plot trainer loss curves from metrics JSONL files")
    ap.add_argument("files", nargs="+", help="metrics files (log.metrics_file)")
    ap.add_argument("-o", "--output", default="loss.png", help="PNG to write (default loss.png)")
    ap.add_argument("--labels", help="comma-separated labels, one per file")
    ap.add_argument("--lr", action="store_true", help="add a learning-rate panel")
    ap.add_argument("--title", default="training loss")
    ap.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    args = ap.parse_args()

    labels = args.labels.split(",") if args.labels else [os.path.basename(f) for f in args.files]
    if len(labels) != len(args.files):
        sys.exit("plot_metrics: --labels needs one label per file")

    rows = 2 if args.lr else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4.5 * rows), sharex=True, squeeze=False)
    ax, ax_lr = axes[0][0], (axes[1][0] if args.lr else None)
    for i, (path, label) in enumerate(zip(args.files, labels)):
        train, evals, lr = read_metrics(path)
        if not train and not evals:
            sys.exit(f"plot_metrics: {path}: no loss records")
        color = f"C{i % 10}"
        if train:
            ax.plot(*zip(*train), color=color, lw=1, alpha=0.8, label=f"{label} train")
        if evals:
            ax.plot(*zip(*evals), color=color, marker="o", ls="--", label=f"{label} eval")
        if ax_lr is not None and lr:
            ax_lr.plot(*zip(*lr), color=color, label=label)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(args.title)
    if args.log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    if ax_lr is not None:
        ax_lr.set_ylabel("learning rate")
        ax_lr.grid(alpha=0.3)
    (ax_lr or ax).set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"plot_metrics: wrote {args.output}")


if __name__ == "__main__":
    main()
