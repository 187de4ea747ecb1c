"""Training metrics: one CSV row per step (and TensorBoard scalars when it is installed)."""

from __future__ import annotations

import csv
import io
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ._checkpoint import atomic_write

COLUMNS = (
    "step",
    "meta_loss",
    "seconds",
    "test_before",
    "test_after",
    "test_after_ci",
    "test_acc_before",
    "test_acc_after",
    "test_acc_after_ci",
)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval, ``1.96 * std / sqrt(n)``.

    The normal approximation papers use for few-shot results (e.g. Finn et al. 2017 report
    accuracies over 600 test tasks with 95% intervals); ``std`` has Bessel's correction.
    """
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


Row = dict[str, float]


def parse(path: Path) -> tuple[list[Row], list[int]]:
    """The rows of a metrics file as floats (``nan`` where a column is empty), and the line
    numbers of the rows that are not whole: a row must hold every column, its step a whole
    number above the row before's (a row cut short by a full disk or a kill, or written by
    another run, is not)."""
    rows: list[Row] = []
    bad: list[int] = []
    with open(path, newline="") as f:
        lines = csv.reader(f)
        header = next(lines, None)
        if header is None:
            return rows, bad
        if tuple(header) != COLUMNS:
            return rows, [1]
        for i, fields in enumerate(lines, 2):
            try:
                if len(fields) != len(COLUMNS):
                    raise ValueError("not every column")
                row = {
                    k: float(v) if v != "" else math.nan
                    for k, v in zip(COLUMNS, fields, strict=True)
                }
                if not fields[0].isdigit() or (rows and row["step"] <= rows[-1]["step"]):
                    raise ValueError("not the next step")
            except ValueError:
                bad.append(i)
                continue
            rows.append(row)
    return rows, bad


def read(path: Path) -> list[Row]:
    """The whole rows of a metrics file (:func:`parse`); the others are left out, named in
    one warning."""
    rows, bad = parse(path)
    if bad:
        warnings.warn(_damaged(path, bad), stacklevel=2)
    return rows


def _damaged(path: Path, lines: Sequence[int]) -> str:
    shown = ", ".join(map(str, lines[:5])) + (
        f" and {len(lines) - 5} more" if len(lines) > 5 else ""
    )
    return (
        f"{path}: {len(lines)} row(s) not whole, left out (line {shown}: cut short, or not "
        "this run's)"
    )


class MetricsLog:
    """Append rows to ``metrics.csv``, each written whole; on resume, make the file agree with
    the checkpoint first.

    Args:
        folder: the run's output folder.
        start_step: the step training starts from (0, or the checkpoint's step).
        saved: the rows the checkpoint holds (:meth:`history`), or ``None`` (a new run, or a
            checkpoint written before checkpoints kept them). With them the file is rebuilt
            from the checkpoint's copy, and a file that disagreed (rows cut, lost, doubled or
            foreign) is named in one warning; without them the file's whole rows up to
            ``start_step`` are kept.
        tensorboard: also write TensorBoard event files when ``torch.utils.tensorboard`` works.
    """

    def __init__(
        self,
        folder: Path,
        start_step: int,
        tensorboard: bool = True,
        saved: torch.Tensor | None = None,
    ) -> None:
        self.path = Path(folder) / "metrics.csv"
        kept: list[Row] = []
        on_disk: list[Row] = []
        bad: list[int] = []
        if start_step > 0 and self.path.exists():
            on_disk, bad = parse(self.path)
            on_disk = [r for r in on_disk if r["step"] <= start_step]
        if saved is not None and start_step > 0:
            kept = [dict(zip(COLUMNS, r, strict=True)) for r in saved.tolist()]
            kept = [r for r in kept if r["step"] <= start_step]
            if not _same(on_disk, kept) or bad:
                warnings.warn(
                    f"{self.path} disagreed with the checkpoint at step {start_step} "
                    f"({_difference(on_disk, kept, bad)}): rewritten from the checkpoint's copy",
                    stacklevel=2,
                )
        else:
            kept = on_disk
            if bad:
                warnings.warn(_damaged(self.path, bad), stacklevel=2)
        self.kept = kept
        self._rewrite()
        # Seconds elapsed by the end of the kept rows: a resumed run's clock continues there.
        self.seconds = kept[-1]["seconds"] if kept and not math.isnan(kept[-1]["seconds"]) else 0.0
        self.file = open(self.path, "a", newline="")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(
                    str(Path(folder) / "tensorboard"), purge_step=start_step + 1
                )
            except Exception:  # tensorboard is optional; without it the CSV is the record
                self.tb = None

    def history(self) -> torch.Tensor:
        """Every row so far, one per line of a float64 tensor in :data:`COLUMNS`' order (for
        the checkpoint, which can rebuild the file from it)."""
        rows = [[float(r.get(k, math.nan)) for k in COLUMNS] for r in self.kept]
        return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(COLUMNS))

    def _rewrite(self) -> None:
        """The header and the kept rows, written atomically."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, COLUMNS)
        w.writeheader()
        for r in self.kept:
            w.writerow(
                dict(
                    {k: self.format(r.get(k, math.nan)) for k in COLUMNS}, step=str(int(r["step"]))
                )
            )
        atomic_write(self.path, lambda f: f.write(buf.getvalue().encode()))

    def complete(self, step: int, values: Mapping[str, float]) -> None:
        """Add ``values`` to the kept row of ``step`` (the last one, written by a run that
        stopped before evaluating it), before any new row."""
        if not self.kept or int(self.kept[-1]["step"]) != step:
            return  # the row was lost with the file: the evaluation still reaches the summary
        self.kept[-1] = {**self.kept[-1], **values}
        self.file.close()
        self._rewrite()
        self.file = open(self.path, "a", newline="")
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, float(v), step)

    @staticmethod
    def format(v: float) -> str:
        if isinstance(v, float) and math.isnan(v):
            return ""
        return repr(float(v))

    def write(self, row: Mapping[str, float]) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown metric(s): {', '.join(sorted(unknown))}")
        out = {k: self.format(float(row[k])) if k in row else "" for k in COLUMNS}
        out["step"] = str(int(row["step"]))
        line = io.StringIO()
        csv.DictWriter(line, COLUMNS).writerow(out)
        # One write of the whole row, then to the file: a full disk or a kill cuts at most
        # this row, which the next read leaves out and a resume rebuilds.
        self.file.write(line.getvalue())
        self.file.flush()
        self.kept.append({k: float(row[k]) if k in row else math.nan for k in COLUMNS})
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and not math.isnan(float(v)):
                    self.tb.add_scalar(k, float(v), int(row["step"]))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _same(a: Sequence[Row], b: Sequence[Row]) -> bool:
    # Every column, the seconds too: the checkpoint's copy and the file were written from the
    # same floats (repr round-trips them exactly); an empty column is None on both sides.
    def key(rows: Sequence[Row]) -> list[tuple[float | None, ...]]:
        return [tuple(None if math.isnan(r[k]) else r[k] for k in COLUMNS) for r in rows]

    return key(a) == key(b)


def _difference(on_disk: Sequence[Row], saved: Sequence[Row], bad: Sequence[int]) -> str:
    disk = {int(r["step"]) for r in on_disk}
    kept = {int(r["step"]) for r in saved}
    parts = []
    if bad:
        parts.append(f"{len(bad)} row(s) not whole")
    if kept - disk:
        parts.append(f"{len(kept - disk)} row(s) missing")
    if disk - kept:
        parts.append(f"{len(disk - kept)} row(s) foreign")
    return ", ".join(parts) or "rows that differ"
