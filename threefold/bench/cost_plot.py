"""The waterfall of `bench cost`: where the cost went, rung by rung (matplotlib, the `bench` extra).

The chain follows the rungs in the order given, keeping each rung that adds techniques to the
last one kept (or swaps round-robin for the router policy); the "alone" rungs drop out. The first bar is the first
rung's cost per million output tokens; each later bar floats from the previous level to the
next (green when the technique lowered the cost, red when it raised it); the last bar is the
final rung's total.
"""

from __future__ import annotations

from pathlib import Path

from threefold.bench.cost_rungs import TECHNIQUES, Rung
from threefold.errors import ThreefoldError


def _step(before: Rung, after: Rung) -> str | None:
    """What `after` adds to `before` ("+prefix", "+prefix+codec"), or None when it also drops something."""
    added, removed = after.features - before.features, before.features - after.features
    if removed == {"rr"} and added == {"router"}:
        return "+router"
    if removed or not added:
        return None
    return "".join(f"+{t}" for t in ("cb", *TECHNIQUES) if t in added)


def stacked_chain(rungs: list[Rung]) -> list[tuple[Rung, str]]:
    """[(first rung, its name), (next rung, '+technique'), ...] following the given order."""
    if not rungs:
        return []
    chain = [(rungs[0], rungs[0].name)]
    for rung in rungs[1:]:
        label = _step(chain[-1][0], rung)
        if label is not None:
            chain.append((rung, label))
    return chain


def waterfall(chain: list[tuple[str, float]], path: Path, title: str) -> Path:
    """chain: [(label, cost per M output tokens)], first the starting rung. Writes a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise ThreefoldError("the waterfall plot needs matplotlib: pip install 'threefold[bench]'",
                             param="out_dir") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in chain] + ["total"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels)), 4.2))
    ax.bar(0, chain[0][1], color="#7f7f7f")
    for i in range(1, len(chain)):
        low, high = sorted((chain[i - 1][1], chain[i][1]))
        color = "#2ca02c" if chain[i][1] < chain[i - 1][1] else "#d62728"
        ax.bar(i, high - low, bottom=low, color=color)
        ax.text(i, high, f"{chain[i][1] - chain[i - 1][1]:+.2f}", ha="center", va="bottom", fontsize=7)
    ax.bar(len(chain), chain[-1][1], color="#1f77b4")
    for i, value in ((0, chain[0][1]), (len(chain), chain[-1][1])):
        ax.text(i, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="$ per million output tokens", title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
