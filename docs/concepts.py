"""Draws docs/concepts.png, the concepts page's picture: two virtual workers of different devices,
each a pipeline of stages, pushing each wave's update to the parameter servers and pulling the
global weights, gated by the staleness bound D (HetPipe §3-§5).

    python docs/concepts.py            # writes docs/concepts.png (needs matplotlib)
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

WORKERS = (("virtual worker 0", ("GPU V", "GPU R", "GPU G")), ("virtual worker 1", ("GPU Q", "GPU Q")))
NM, WAVES = 3, 3


def box(ax, x, y, w, h, text, colour, size=9):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=colour, ec="#333333", lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, start, end, text, colour, side):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=colour, lw=1.4))
    x = (start[0] + end[0]) / 2 + (0.15 if side == "right" else -0.15)
    ax.text(x, (start[1] + end[1]) / 2, text, fontsize=8, color=colour, va="center",
            ha="left" if side == "right" else "right")


def draw_cluster(ax):
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6)
    ax.axis("off")
    box(ax, 3.2, 4.8, 3.6, 0.8, "parameter servers: global weights, WSP clock", "#e8e8f8")
    for i, (name, devices) in enumerate(WORKERS):
        x0 = 0.3 + i * 5.1
        ax.text(x0 + 2.2, 1.95, f"{name} (Nm = {NM})", ha="center", fontsize=10, weight="bold")
        for s, device in enumerate(devices):
            w = 4.4 / len(devices)
            box(ax, x0 + s * w + 0.05, 2.2, w - 0.1, 0.9, f"stage {s}\n{device}", "#fff2cc")
            if s:
                ax.annotate("", (x0 + s * w + 0.05, 2.65), (x0 + s * w - 0.05, 2.65),
                            arrowprops={"arrowstyle": "-|>", "color": "#555555"})
        # Labelled once each, on the outer arrows.
        arrow(ax, (x0 + 1.4, 3.15), (3.6 + i * 2.0, 4.75), "" if i else "push: one per wave", "#2ca02c", "left")
        arrow(ax, (4.4 + i * 2.0, 4.75), (x0 + 3.0, 3.15), "pull: gated by D" if i else "", "#9467bd", "right")
    ax.text(5, 1.2, "activations go forward, gradients back; each minibatch p trains on a stashed weight version\n"
                    "that holds the local updates of minibatches 1 .. p - Nm and the global weights last pulled",
            ha="center", fontsize=8.5, style="italic")


def draw_waves(ax):
    ax.set_xlim(0, WAVES * NM + 1)
    ax.set_ylim(-0.8, 2)
    ax.axis("off")
    for row, speed in ((1, 1.0), (0, 0.75)):
        ax.text(-0.1, row + 0.3, f"worker {1 - row}", ha="right", va="center", fontsize=9)
        for p in range(int(WAVES * NM * speed)):
            wave = p // NM
            ax.add_patch(FancyBboxPatch((p + 0.05, row + 0.05), 0.9, 0.5, boxstyle="round,pad=0.01",
                                        fc=("#cfe2f3", "#d9ead3", "#fce5cd")[wave % 3], ec="#666666"))
            ax.text(p + 0.5, row + 0.3, str(p + 1), ha="center", va="center", fontsize=8)
            if p % NM == NM - 1:
                ax.plot([p + 1, p + 1], [row, row + 0.6], color="#2ca02c", lw=2)
    ax.text(0, -0.55, f"a wave = Nm = {NM} minibatches; its end (green) is a push and the worker's clock ticks; the "
                      "fastest worker runs at most D clocks ahead of the slowest", fontsize=8.5)


def main(output):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), gridspec_kw={"height_ratios": [2.2, 1]})
    draw_cluster(top)
    draw_waves(bottom)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"drawn to {output}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "concepts.png"))
