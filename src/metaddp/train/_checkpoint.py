"""Checkpoints written atomically and read back with a clear error when they do not fit.

A checkpoint holds the meta-parameters, the outer optimizer's state, the step reached and the
configuration. No random state is needed: every task is a function of (seed, global index),
so the step number alone says where the data stream continues. A sharded run's file holds,
in place of the tensors, the folder of their sharded state (:mod:`._sharded_state`), written
before it.

Every checkpoint proves itself: it holds the CRC-32 of each of its tensors' bytes and of
everything else in it (:func:`checksums`), checked when it is read. A checkpoint whose bytes
changed after it was written (a flipped bit on a disk or in a copy) is refused like a truncated
one, and a resume takes the one before it, saying so.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .._output import atomic_write

FORMAT = "metaddp-checkpoint-2"
# Read as well: the first format is the second without "checksums".
FORMATS = ("metaddp-checkpoint-1", FORMAT)
KEYS = ("format", "step", "config")  # and "model" and "optimizer", or "sharded"
STRUCTURE = "(structure)"  # the checksum of all but the tensors' bytes (:func:`checksums`)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or from another configuration."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file that cannot be read back (truncated, overwritten, not a checkpoint)."""


# Checkpoints kept: the newest as checkpoint.pt, the one before as checkpoint.1.pt, ...
KEEP = 3


DCP_INDEX = ".metadata"  # the index torch.distributed.checkpoint writes last


def complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole sharded (DCP) state: its index is written last."""
    return (Path(folder) / DCP_INDEX).is_file()


def crc32(t: torch.Tensor) -> int:
    """The CRC-32 of a tensor's bytes, in its dtype, on the CPU, in row-major order."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def _structure(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> str:
    """``value`` as text, with each tensor's dtype and shape in its place; collects the tensors
    by their path (``model/0.weight``, ``optimizer/state/0/exp_avg``)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return f"tensor({value.dtype}, {list(value.shape)})"
    inner = lambda key: f"{path}/{key}" if path else str(key)  # noqa: E731
    if isinstance(value, Mapping):
        items = [f"{k!r}: {_structure(v, inner(k), tensors)}" for k, v in value.items()]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):  # a tuple saved may come back a tuple or a list
        return "[" + ", ".join(_structure(v, inner(i), tensors) for i, v in enumerate(value)) + "]"
    return repr(value)


def checksums(state: Mapping[str, Any]) -> dict[str, int]:
    """The CRC-32 of each tensor of a checkpoint's dict, by its path, and under
    :data:`STRUCTURE` that of everything else (the step, the settings, the optimizer's
    settings, every tensor's path, dtype and shape). The dict's own ``"checksums"`` are left
    out."""
    tensors: dict[str, torch.Tensor] = {}
    rest = _structure({k: v for k, v in state.items() if k != "checksums"}, "", tensors)
    return {STRUCTURE: zlib.crc32(rest.encode())} | {p: crc32(t) for p, t in tensors.items()}


def _check(path: Path, state: Mapping[str, Any]) -> None:
    """Refuse ``state`` (read from ``path``) if it does not match the checksums it holds."""
    recorded = state.get("checksums")
    if not isinstance(recorded, dict):
        raise CorruptCheckpoint(f"checkpoint {path} has lost its checksums")
    try:
        now = checksums(state)
        failed = [k for k in sorted(set(now) | set(recorded)) if now.get(k) != recorded.get(k)]
    except Exception as e:  # a flipped bit in a stride, a dtype or a key: unreadable as saved
        raise CorruptCheckpoint(
            f"checkpoint {path} fails its checksum (it no longer reads as it was written: "
            f"{type(e).__name__}): its bytes changed after it was written"
        ) from e
    if failed:
        named = ["everything but the tensors" if k == STRUCTURE else k for k in failed]
        more = f" and {len(named) - 3} more" if len(named) > 3 else ""
        raise CorruptCheckpoint(
            f"checkpoint {path} fails its checksum ({', '.join(named[:3])}{more}): its bytes "
            "changed after it was written"
        )


def history(path: Path, keep: int = KEEP) -> list[Path]:
    """``path`` and its older copies, newest first (``checkpoint.pt``, ``checkpoint.1.pt``...)."""
    path = Path(path)
    return [path] + [path.with_name(f"{path.stem}.{i}{path.suffix}") for i in range(1, keep)]


def exists(path: Path) -> bool:
    """Whether ``path`` or one of its older copies is there to resume from."""
    return any(p.is_file() for p in history(path))


def save(
    path: Path,
    *,
    step: int,
    config: Mapping[str, Any],
    model: Mapping[str, Any] | None = None,
    optimizer: Mapping[str, Any] | None = None,
    sharded: Mapping[str, Any] | None = None,
    evaluation_due: bool = False,
    metrics: torch.Tensor | None = None,
    world: int | None = None,
) -> None:
    """Write a checkpoint atomically, keeping the :data:`KEEP` - 1 before it.

    The older copies move down one place first (``checkpoint.pt`` becomes
    ``checkpoint.1.pt``...), each by an atomic rename, so a crash at any moment leaves every
    complete checkpoint readable under one of the names :func:`load_latest` tries.

    Args:
        path: the file to (over)write.
        step: the number of outer steps completed.
        config: the run's resolved configuration (a plain dict).
        model: the algorithm's ``state_dict()``.
        optimizer: the outer optimizer's ``state_dict()``.
        sharded: in place of ``model`` and ``optimizer``, the record of their sharded state
            (:func:`._sharded_state.save`, already written): its folder, relative to the
            file's.
        evaluation_due: the run stopped at this step before its due evaluation, which the
            resume runs first.
        metrics: the rows of ``metrics.csv`` so far (``MetricsLog.history``), from which a
            resume rebuilds a file that a full disk or a kill damaged.
        world: the number of processes the run runs on (a resume keeps it).
    """
    if (sharded is None) == (model is None or optimizer is None):
        raise TypeError("a checkpoint holds the model and the optimizer, or their sharded state")
    state: dict[str, Any] = {
        "format": FORMAT,
        "step": int(step),
        "config": dict(config),
        "evaluation_due": bool(evaluation_due),
    }
    if sharded is not None:
        state["sharded"] = dict(sharded)
    else:
        assert model is not None
        state.update(model=dict(model), optimizer=optimizer)
    if metrics is not None:
        state["metrics"] = metrics
    if world is not None:
        state["world"] = int(world)
    state["checksums"] = checksums(state)
    older = history(Path(path))
    for new, old in zip(older[:0:-1], older[-2::-1], strict=True):
        if old.is_file():
            os.replace(old, new)
    atomic_write(Path(path), lambda f: torch.save(state, f))


def settings_before(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a setting added since meant in checkpoints written before it existed: the image
    network had no BatchNorm, inner steps were SGD, forward passes ran in the run's dtype,
    runs were not deterministic, and the outer learning rate was constant."""
    image = config.get("ways") is not None
    return {
        "norm": "none" if image else None,
        "inner_optimizer": "sgd",
        "autocast": None,
        "deterministic": False,
        "chunks": 8,
        "outer_schedule": "constant",
    }


def load(path: Path, identity: Mapping[str, Any], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint and check that it belongs to a run with the same ``identity``.

    Args:
        path: the checkpoint file.
        identity: the settings that must match (task, algorithm, learning rates, seed ...).
        map_location: where tensors are loaded.

    Returns:
        The checkpoint's dict (keys ``step``, ``config``, and ``model`` and ``optimizer`` or
        ``sharded``).

    Raises:
        CheckpointError: missing, corrupt, not a metaddp checkpoint, or another configuration.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: nothing to resume")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    if (
        not isinstance(state, dict)
        or state.get("format") not in FORMATS
        or any(k not in state for k in KEYS)
        or not (("model" in state and "optimizer" in state) or "sharded" in state)
    ):
        raise CorruptCheckpoint(f"{path} is not a metaddp training checkpoint")
    if state["format"] != FORMATS[0]:  # the first format had no checksums
        _check(path, state)
    if "sharded" in state:
        record = state["sharded"]
        name = record.get("folder") if isinstance(record, dict) else None
        if not isinstance(name, str):
            raise CorruptCheckpoint(f"{path} is not a metaddp training checkpoint")
        folder = path.parent / name
        if not complete(folder):
            raise CorruptCheckpoint(
                f"checkpoint {path} names its sharded state {folder}, which is missing or "
                "incomplete"
            )
    saved = {**settings_before(state["config"]), **state["config"]}
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}"
        for k, v in identity.items()
        if saved.get(k) != v
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint {path} comes from another configuration ({'; '.join(diff)}). Resume "
            "with the same settings, or start a new run in another --out folder"
        )
    return state


def load_latest(
    path: Path,
    identity: Mapping[str, Any],
    map_location: Any = "cpu",
    verify: Callable[[Path, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The newest checkpoint of :func:`history` that reads back and proves itself. A missing or
    damaged newer one falls back to the one before, in one warning that names each one passed
    over and why, and the file and step resumed from.

    Args:
        path: the newest checkpoint's file (``checkpoint.pt``).
        identity: the settings that must match (:func:`load`).
        map_location: where tensors are loaded.
        verify: called with each candidate's path and dict once :func:`load` accepts it; a
            :class:`CorruptCheckpoint` it raises falls back like an unreadable file (a sharded
            state whose files fail their checksums). Every process calls it alike.

    Raises:
        CheckpointError: none can be read, or one comes from another configuration (that is
            a wrong folder or wrong settings, never a reason to fall back).
    """
    passed: list[str] = []  # why each newer candidate was passed over
    damaged: list[str] = []
    for candidate in history(Path(path)):
        if not candidate.is_file():
            passed.append(f"{candidate} is missing")
            continue
        try:
            state = load(candidate, identity, map_location)
            if verify is not None:
                verify(candidate, state)
        except CorruptCheckpoint as e:
            passed.append(str(e))
            damaged.append(str(e))
            continue
        if passed:
            warnings.warn(
                f"{'; '.join(passed)}; resuming from {candidate.name} (step {state['step']})",
                RuntimeWarning,
                stacklevel=2,
            )
        return state
    if damaged:
        raise CorruptCheckpoint(
            f"{'; '.join(damaged)}; no checkpoint in {Path(path).parent} reads back whole: "
            "restore one from a copy or start a new run"
        )
    raise CheckpointError(f"no checkpoint at {path}: nothing to resume")
