"""PNG plots from the JSON the benchmark scripts wrote (matplotlib, no display needed).

    python benchmarks/plots.py benchmarks/results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _log_axes(ax, xlabel: str, ylabel: str) -> None:  # type: ignore[no-untyped-def]
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def _save(fig, out: Path) -> Path:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def growth(results: Path) -> Path | None:
    src = results / "growth.json"
    if not src.exists():
        return None
    data = json.loads(src.read_text())
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    impls = sorted({r["impl"] for r in data["rows"]})
    for impl in impls:
        rows = sorted((r for r in data["rows"] if r["impl"] == impl and r["axis"] == "steps"),
                      key=lambda r: r["value"])
        xs = [r["value"] for r in rows]
        ax_t.plot(xs, [r["median_ms"] for r in rows], marker="o", label=impl)
        ax_m.plot(xs, [r["peak_extra_mib"] or float("nan") for r in rows], marker="o", label=impl)
    for ax, label in ((ax_t, "median ms per meta-step"), (ax_m, "peak extra resident MiB")):
        _log_axes(ax, "inner steps", label)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"{data['case']}, second order; {data['date']}", fontsize=9)
    return _save(fig, results / "growth_steps.png")


def scaling(results: Path) -> Path | None:
    src = results / "scaling.json"
    if not src.exists():
        return None
    data = json.loads(src.read_text())
    fig, ax = plt.subplots(figsize=(8, 4))
    groups = []
    for r in data["rows"]:
        key = (r["case"].split(",")[0], r["layout"])
        if key not in groups:
            groups.append(key)
    configs = [(1, 1), (1, 2), (2, 1)]
    width = 0.25
    for j, (nproc, threads) in enumerate(configs):
        vals = []
        for case, layout in groups:
            match = [r for r in data["rows"] if r["case"].startswith(case) and r["layout"] == layout
                     and r["nproc"] == nproc and r["threads"] == threads]
            vals.append(match[0]["throughput_vs_1x1"] if match else 0.0)
        ax.bar([i + (j - 1) * width for i in range(len(groups))], vals, width,
               label=f"{nproc} process(es) x {threads} thread(s)")
    ax.axhline(1.6, color="gray", linestyle="--", linewidth=1, label="target 1.6x")
    ax.set_xticks(range(len(groups)), [f"{c}\n{layout}-parallel" for c, layout in groups],
                  fontsize=8)
    ax.set_ylabel("throughput vs 1 process x 1 thread")
    ax.legend(fontsize=7)
    ax.set_title(f"gloo on CPU, fixed global meta-batch; {data['date']}", fontsize=9)
    return _save(fig, results / "scaling.png")


def remat_memory(results: Path) -> Path | None:
    """Second-order peak memory against K: default, ``memory="low"`` (with and without the
    weights it keeps) and first order, one panel per problem."""
    src = results / "remat_memory.json"
    if not src.exists():
        return None
    data = json.loads(src.read_text())
    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    titles = {"conv": "Conv-4 + BatchNorm, 8 tasks", "sine": "sinusoid MLP, 25 tasks"}
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        rows = sorted((r for r in data["rows"] if r["case"] == case), key=lambda r: r["steps"])
        ks = [r["steps"] for r in rows]
        for mode, style in (("default", "o-"), ("first-order", "s--"), ("low", "^-")):
            ax.plot(ks, [r[mode]["peak_mib"] for r in rows], style, label=mode)
        ax.plot(ks, [r["low"]["peak_mib"] + r["low"]["kept_mib"] for r in rows], "^:",
                label="low, with the weights it keeps")
        _log_axes(ax, "inner steps K", "peak MiB held for the backward")
        ax.set_title(titles.get(case, case), fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"second-order MAML, one meta-step, CPU; {data['date']}", fontsize=9)
    return _save(fig, results / "remat_memory.png")


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results"
    for made in (growth(results), scaling(results), remat_memory(results)):
        if made:
            print(made)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
