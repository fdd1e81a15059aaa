"""Plots the ratios of a `benchmarks/run.py --json` run: how many times faster
orbax_eqx saves and restores than each other contender, per model.

    python benchmarks/run.py --repeats 1 --json bench.json
    python benchmarks/plot.py bench.json docs/images/benchmark_ratios.png

Every ratio is between medians of the same run (the machine is shared and
noisy; only same-run ratios are stable). Bars above 1 are orbax_eqx faster.
Needs matplotlib (`pip install -e ".[docs]"`).
"""

import argparse
import json
import statistics
import textwrap

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

ME = "orbax_eqx"
NAMES = {"orbax": "plain Orbax", "eqx": "eqx.tree_serialise_leaves", "raw": "raw disk"}


def ratios(results: dict) -> dict[str, dict[str, tuple[float, float]]]:
    """`{model label: {contender: (save ratio, restore ratio)}}`, each ratio
    the contender's median time over orbax_eqx's."""
    out = {}
    for r in results.values():
        med = {
            kind: {c: statistics.median(ts) for c, ts in r[kind].items()}
            for kind in ("save", "restore")
        }
        save, restore = med["save"], med["restore"]
        out[r["label"]] = {
            c: (save[c] / save[ME], restore[c] / restore[ME]) for c in save if c != ME
        }
    return out


def plot(doc: dict, out: str) -> None:
    table = ratios(doc["results"])
    models = list(table)
    contenders = [c for c in NAMES if any(c in table[m] for m in models)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), sharey=True)
    width = 0.8 / max(len(contenders), 1)
    for ax, kind, index in zip(axes, ("save", "restore"), (0, 1), strict=True):
        for i, c in enumerate(contenders):
            values = [table[m].get(c, (float("nan"),) * 2)[index] for m in models]
            shift = (i - (len(contenders) - 1) / 2) * width
            xs = [j + shift for j in range(len(models))]
            bars = ax.bar(xs, values, width, label=f"vs {NAMES[c]}")
            ax.bar_label(bars, labels=[f"{v:.2g}x" for v in values], fontsize=7)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(models)), [_short(m) for m in models], fontsize=8)
        ax.set_title(f"{kind}: times faster than ...")
    axes[0].set_ylabel("their time / orbax_eqx's time (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.suptitle(textwrap.fill(doc.get("machine", ""), 150), fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=110)


def _short(label: str) -> str:
    """`(a) transformer ~0.5 GiB` as `(a)` over the rest, to fit under a bar
    group."""
    name, _, rest = label.partition(" ")
    return f"{name}\n{textwrap.fill(rest, 16)}" if rest else name


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="the file `run.py --json` wrote")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        plot(json.load(f), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
