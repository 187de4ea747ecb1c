"""Training metrics: one CSV row per step (and TensorBoard scalars when it is installed)."""

from __future__ import annotations

import csv
import io
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

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


def read(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics file as floats (``nan`` where a column is empty). A row that
    does not read as numbers (the last one, cut short by a full disk or a kill) is left out,
    with a warning."""
    rows = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), 2):
            try:
                rows.append(
                    {k: float(v) if v not in ("", None) else math.nan for k, v in row.items()}
                )
            except (TypeError, ValueError):
                warnings.warn(f"{path}, line {i}, is damaged (cut short?): left out", stacklevel=2)
    return rows


class MetricsLog:
    """Append rows to ``metrics.csv``; on resume, first drop rows after the checkpoint's step.

    Args:
        folder: the run's output folder.
        start_step: the step training starts from (0, or the checkpoint's step).
        tensorboard: also write TensorBoard event files when ``torch.utils.tensorboard`` works.
    """

    def __init__(self, folder: Path, start_step: int, tensorboard: bool = True) -> None:
        self.path = Path(folder) / "metrics.csv"
        kept: list[dict[str, float]] = []
        if start_step > 0 and self.path.exists():
            kept = [r for r in read(self.path) if r["step"] <= start_step]
        self.kept = kept
        self._rewrite()
        # Seconds elapsed by the end of the kept rows: a resumed run's clock continues there.
        self.seconds = kept[-1]["seconds"] if kept and not math.isnan(kept[-1]["seconds"]) else 0.0
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, COLUMNS)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(
                    str(Path(folder) / "tensorboard"), purge_step=start_step + 1
                )
            except Exception:  # tensorboard is optional; without it the CSV is the record
                self.tb = None

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
        self.writer = csv.DictWriter(self.file, COLUMNS)
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
        self.writer.writerow(out)
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and not math.isnan(float(v)):
                    self.tb.add_scalar(k, float(v), int(row["step"]))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
