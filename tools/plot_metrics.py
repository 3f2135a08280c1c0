#!/usr/bin/python3
"""plot_metrics: draws loss curves from trainer metrics files (JSONL) into one PNG.

    tools/plot_metrics.py out/demo/metrics.jsonl [more.jsonl ...] -o loss.png [--lr] [--title T]

Each file is one run (labelled by its file name, or by --labels). Train loss is drawn as a thin
line, eval loss as markers on the same colour; with --lr a second panel shows the learning rate.
Reads only the records the trainer writes: {"plan": ...} first, then {"step", "loss", "lr", ...}
per optimizer step and {"step", "eval_loss"} per eval. Uses matplotlib's Agg backend (no display).

A plot is never silently replaced by one of other data: the PNG records the metrics files it was
drawn from (a "meshrun-metrics" text chunk); an existing output is redrawn when it came from the
same files (a plot of a run that went on), and refused otherwise unless --overwrite is given.
"""
import argparse
import json
import os
import struct
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def die(msg):
    """A bad input: one line on stderr, exit 2."""
    print(f"plot_metrics: {msg}", file=sys.stderr)
    sys.exit(2)


def read_metrics(path):
    train, evals, lr = [], [], []
    try:
        f = open(path)
    except OSError as e:
        die(f"{path}: {e.strerror}")
    with f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                die(f"{path}:{n}: not JSON: {e}")
            if "eval_loss" in rec:
                evals.append((rec["step"], rec["eval_loss"]))
            elif "loss" in rec:
                train.append((rec["step"], rec["loss"]))
                if "lr" in rec:
                    lr.append((rec["step"], rec["lr"]))
    return train, evals, lr


SOURCES_KEY = "meshrun-metrics"


def png_sources(path):
    """The metrics files a PNG of ours was drawn from (its text chunk), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    at = 8
    while at + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + n]
        if kind == b"tEXt" and body.startswith(SOURCES_KEY.encode() + b"\0"):
            try:
                return json.loads(body[len(SOURCES_KEY) + 1:].decode("latin-1"))
            except ValueError:
                return None
        if kind == b"IEND":
            break
        at += 12 + n
    return None


def main():
    ap = argparse.ArgumentParser(description="plot trainer loss curves from metrics JSONL files")
    ap.add_argument("files", nargs="+", help="metrics files (log.metrics_file)")
    ap.add_argument("-o", "--output", default="loss.png", help="PNG to write (default loss.png)")
    ap.add_argument("--labels", help="comma-separated labels, one per file")
    ap.add_argument("--lr", action="store_true", help="add a learning-rate panel")
    ap.add_argument("--title", default="training loss")
    ap.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output drawn from other metrics files (or not by this script)")
    args = ap.parse_args()

    labels = args.labels.split(",") if args.labels else [os.path.basename(f) for f in args.files]
    if len(labels) != len(args.files):
        die("--labels needs one label per file")

    rows = 2 if args.lr else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4.5 * rows), sharex=True, squeeze=False)
    ax, ax_lr = axes[0][0], (axes[1][0] if args.lr else None)
    for i, (path, label) in enumerate(zip(args.files, labels)):
        train, evals, lr = read_metrics(path)
        if not train and not evals:
            die(f"{path}: no loss records")
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
    sources = [os.path.realpath(f) for f in args.files]
    if os.path.exists(args.output) and not args.overwrite:
        old = png_sources(args.output)
        if old != sources:
            drawn = "drawn from " + ", ".join(old) if old else "not drawn by plot_metrics"
            die(f"{args.output} exists ({drawn}): --overwrite replaces it, or choose another -o")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120, metadata={SOURCES_KEY: json.dumps(sources)})
    print(f"plot_metrics: wrote {args.output}")


if __name__ == "__main__":
    main()
