"""The benchmark's bar chart: whole-step time and peak memory per mode, one bar per tree.

Drawing needs matplotlib, imported when a chart is drawn, so this module imports without it.

A tree is the code a mode ran: this checkout ("ours"), an upstream release ("0.19.8"), or torch alone (the DDP
reference). Modes that differ only in their tree share a group, so each group compares the trees directly.
"""

from dataclasses import dataclass
from typing import Optional

OURS = "ours"
TORCH = "torch DDP"
# Fixed colours for the trees every run has; upstream releases take the rest in version order.
TREE_COLORS = {OURS: "#1f77b4", TORCH: "#7f7f7f"}
RELEASE_COLORS = ("#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#e377c2")
BAR_HEIGHT = 0.26  # of a group's unit of height: up to three trees side by side leave a gap between groups


@dataclass(frozen=True)
class Bar:
    """One mode of one tree.

    Attributes:
        group: the mode without its tree, e.g. "ds-z2-bf16-muon".
        tree: "ours", "torch DDP" or an upstream release such as "0.19.8".
        step_ms: median whole step; step_lo_ms / step_hi_ms: its whisker (p10, p90), when known.
        peak_gib: peak memory per GPU.
    """

    group: str
    tree: str
    step_ms: float
    peak_gib: Optional[float] = None
    step_lo_ms: Optional[float] = None
    step_hi_ms: Optional[float] = None


def tree_colors(trees: list) -> dict:
    """A colour per tree: ours and torch fixed, releases from a palette in their order."""
    releases = [tree for tree in trees if tree not in TREE_COLORS]
    colors = {tree: RELEASE_COLORS[index % len(RELEASE_COLORS)] for index, tree in enumerate(releases)}
    return {tree: TREE_COLORS.get(tree, colors.get(tree)) for tree in trees}


def step_and_memory_chart(bars: list, title: str, path) -> None:
    """Write a PNG with two panels of horizontal grouped bars: whole step (ms, whiskers p10-p90) and peak memory.

    Args:
        bars: `Bar`s; groups appear top to bottom in order of first appearance, the trees of a group in the
            order `trees_in_order` gives.
        title: the figure's title.
        path: where the PNG goes.
    """
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys(bar.group for bar in bars))
    trees = trees_in_order(bars)
    colors = tree_colors(trees)
    # Each group is one unit of height; the trees it has share it, centred on the group's tick.
    positions = {}
    for index, group in enumerate(groups):
        present = [bar for tree in trees for bar in bars if bar.group == group and bar.tree == tree]
        for slot, bar in enumerate(present):
            positions[id(bar)] = index + (slot - (len(present) - 1) / 2) * BAR_HEIGHT
    figure = Figure(figsize=(13, 1.6 + 0.3 * len(bars) + 0.25 * len(groups)), dpi=100, layout="constrained")
    step_axes, memory_axes = figure.subplots(1, 2, sharey=True)
    for tree in trees:
        rows = [bar for bar in bars if bar.tree == tree]
        y = [positions[id(bar)] for bar in rows]
        whiskers = [[bar.step_ms - (bar.step_ms if bar.step_lo_ms is None else bar.step_lo_ms) for bar in rows],
                    [(bar.step_ms if bar.step_hi_ms is None else bar.step_hi_ms) - bar.step_ms for bar in rows]]
        drawn = step_axes.barh(y, [bar.step_ms for bar in rows], BAR_HEIGHT, xerr=whiskers, color=colors[tree],
                               label=tree, error_kw={"elinewidth": 1, "capsize": 2})
        step_axes.bar_label(drawn, fmt="%.1f", padding=3, fontsize=7)
        with_memory = [(y_pos, bar.peak_gib) for y_pos, bar in zip(y, rows) if bar.peak_gib is not None]
        if with_memory:
            drawn = memory_axes.barh([y_pos for y_pos, _ in with_memory], [gib for _, gib in with_memory],
                                     BAR_HEIGHT, color=colors[tree], label=tree)
            memory_axes.bar_label(drawn, fmt="%.2f", padding=3, fontsize=7)
    step_axes.set_yticks(range(len(groups)), groups)
    step_axes.invert_yaxis()
    step_axes.set_xlabel("whole training step, ms (median; whisker p10-p90)")
    memory_axes.set_xlabel("peak memory per GPU, GiB")
    for axes in (step_axes, memory_axes):
        axes.grid(axis="x", color="#dddddd")
        axes.set_axisbelow(True)
        axes.margins(x=0.15)
    step_axes.legend(title="tree", loc="lower right", fontsize=8)
    figure.suptitle(title)
    figure.savefig(path, format="png")


def trees_in_order(bars: list) -> list:
    """Ours first, then upstream releases by version, then the torch reference."""
    trees = set(bar.tree for bar in bars)
    releases = sorted(trees - {OURS, TORCH}, key=_version_key)
    return [tree for tree in (OURS, *releases, TORCH) if tree in trees]


def _version_key(tree: str) -> tuple:
    parts = []
    for part in tree.split("."):
        parts.append((0, int(part), "") if part.isdigit() else (1, 0, part))
    return tuple(parts)
