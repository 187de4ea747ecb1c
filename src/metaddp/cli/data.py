"""``metaddp data``: what an image task family holds, and a picture of a few of its tasks.

  metaddp data glyphs                                  # alphabets, classes, grid.png
  metaddp data omniglot --data DIR --out omni.png
  metaddp data miniimagenet --data DIR --ways 5 --shots 1 --tasks 2

Prints, per split, the classes, the examples per class and (where the data has them) the
alphabets with their number of characters; then writes a PNG grid of ``--tasks`` sampled tasks
of ``--split``, one row per class: its support images, then its query images.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..tasks import FAMILIES, FewShotImages, family_class, make

IMAGE_FAMILIES = tuple(f for f in FAMILIES if f != "sinusoid")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="show what an image task family holds and draw a few of its tasks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", choices=IMAGE_FAMILIES, help="image task family")
    p.add_argument("--data", default=None, help="dataset folder (glyphs: cache folder)")
    p.add_argument(
        "--fonts", default=None, help="glyphs: all (default), matplotlib, or an identity"
    )
    p.add_argument("--ways", type=int, default=5, help="classes per task (default 5)")
    p.add_argument("--shots", type=int, default=1, help="support images per class (default 1)")
    p.add_argument("--query", type=int, default=3, help="query images per class (default 3)")
    p.add_argument("--tasks", type=int, default=3, help="tasks to draw (default 3)")
    p.add_argument("--split", choices=("train", "test"), default="test", help="default test")
    p.add_argument("--seed", type=int, default=0, help="which tasks (default 0)")
    p.add_argument(
        "--out",
        default="grid.png",
        help="PNG file to write, or a folder for its grid.png (default grid.png)",
    )
    p.set_defaults(func=main)


def inventory(family: FewShotImages) -> dict[str, Any]:
    """Per split: ``classes``, ``examples`` (min, max per class) and ``alphabets`` (name ->
    characters, where the family has alphabets)."""
    out: dict[str, Any] = {}
    groups = getattr(family, "alphabets", {})
    for split, pool in family.pools.items():
        sizes = [int(c.shape[0]) for c in pool]
        out[split] = {
            "classes": len(pool),
            "examples": (min(sizes), max(sizes)),
            "alphabets": dict(groups.get(split, {})),
        }
    return out


def report(name: str, family: FewShotImages) -> list[str]:
    lines = [f"{name}: {family.channels}x{family.size}x{family.size} images"]
    fonts = getattr(family, "fonts", None)
    if fonts:
        lines.append(f"  drawn from {len(fonts.split(','))} font files")
    for split, info in inventory(family).items():
        lo, hi = info["examples"]
        per = f"{lo}" if lo == hi else f"{lo}-{hi}"
        head = f"  {split}: {info['classes']} classes, {per} examples per class"
        if info["alphabets"]:
            chars = sum(info["alphabets"].values())
            head += f"; {len(info['alphabets'])} alphabets, {chars} characters"
        lines.append(head)
        for a, n in sorted(info["alphabets"].items()):
            lines.append(f"    {a}: {n}")
    return lines


def grid(family: FewShotImages, *, seed: int, tasks: int, split: str, path: Path) -> None:
    """A PNG of ``tasks`` tasks side by side: per class a row, support images (blue frame)
    then query images (orange frame)."""
    from .._output import pyplot

    plt = pyplot()
    ways, shots, query = family.ways, family.shots, family.query
    cols = shots + query
    fig, axes = plt.subplots(
        ways,
        tasks * (cols + 1) - 1,
        figsize=(max(3.5, 0.9 * (tasks * (cols + 1) - 1)), 0.9 * ways + 0.8),
        squeeze=False,
    )
    for ax in axes.flat:
        ax.axis("off")
    for t in range(tasks):
        task = family.task(seed, t, split)
        left = t * (cols + 1)
        for part, batch, offset, colour in (
            ("support", task.support, 0, "tab:blue"),
            ("query", task.query, shots, "tab:orange"),
        ):
            seen = [0] * ways
            for x, y in zip(batch.x, batch.y.tolist(), strict=True):
                ax = axes[y, left + offset + seen[y]]
                seen[y] += 1
                img = x.permute(1, 2, 0).numpy() if x.shape[0] == 3 else x[0].numpy()
                ax.imshow(img, cmap=None if x.shape[0] == 3 else "gray_r", vmin=0, vmax=1)
                ax.axis("on")
                ax.set_xticks([])
                ax.set_yticks([])
                for s in ax.spines.values():
                    s.set_edgecolor(colour)
                    s.set_linewidth(2)
            axes[0, left + offset].set_title(part, fontsize=8, loc="left")
        axes[0, left + cols // 2].set_title(f"task {t}", fontsize=9, pad=14)
    fig.suptitle(
        f"{family.name}: {tasks} {split} task{'s' if tasks > 1 else ''}\n"
        f"{ways}-way {shots}-shot, {query} query per class",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MOST_TASKS = 20  # a picture's worth: 150 tasks took 149 s to draw


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        if not 1 <= args.tasks <= MOST_TASKS:
            raise ValueError(
                f"--tasks must be between 1 and {MOST_TASKS} (one picture), got {args.tasks}"
            )
        if out.is_dir():
            out = out / "grid.png"
        if out.suffix.lower() != ".png":
            raise ValueError(f"--out must name a .png file, got {args.out}")
        family_class(args.task).refuse_unread_data(args.data)
        family = make(
            args.task,
            shots=args.shots,
            query=args.query,
            ways=args.ways,
            data=args.data,
            fonts=args.fonts,
        )
    except (ValueError, ImportError, OSError) as e:
        print(f"metaddp data: error: {e}", file=sys.stderr)
        return 2
    assert isinstance(family, FewShotImages)
    print("\n".join(report(args.task, family)))
    try:
        grid(family, seed=args.seed, tasks=args.tasks, split=args.split, path=out)
    except ImportError as e:
        print(f"metaddp data: no picture: {e}", file=sys.stderr)
        return 0
    except OSError as e:
        print(f"metaddp data: error: cannot write {out}: {e}", file=sys.stderr)
        return 2
    print(f"  tasks drawn: {out}")
    return 0
