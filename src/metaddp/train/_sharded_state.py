"""A sharded run's checkpoint state through ``torch.distributed.checkpoint`` (DCP): saved as
each process holds it, loaded at any number of processes and layout.

With ``shard``, each process holds its rows of every meta-parameter (``MetaDDP(shard=True)``,
:class:`metaddp.distributed._sharded.Cut`) and Adam's state for them. Saving wraps each such
piece as a DTensor of the run's device mesh, ``[Replicate(), Shard(0)]`` over its ``("task",
"sample")`` dimensions (the cut follows ``torch.chunk``, as DTensor's ``Shard(0)``), so DCP
writes every row once, in one file per process, whatever the layout. Everything whole (buffers,
0-d parameters, the parameters of a replicated run, Adam's ``step``) goes in as a plain tensor,
written once. Loading builds the same DTensors for the *current* layout and lets DCP read the
rows each process holds now: a run saved on 2 processes resumes on 3, on 1, or replicated.

The folder of one checkpoint is ``shards/step-S-TOKEN`` under the run folder; the small
checkpoint file (:mod:`._checkpoint`) names it and is written last, atomically, so a crash at
any moment leaves either no reference to a half-written folder or a complete one. Folders no
kept checkpoint names are removed after each save (:func:`collect`).

The record the checkpoint file keeps holds the CRC-32 of every file of the folder (each process
reads back its share of them after the save); a resume checks them (:func:`verify`) before
reading any, each process its share, and the processes agree on the verdict, so that a
flipped bit in any shard makes every process fall back to the checkpoint before alike.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._checkpoint import DCP_INDEX, CheckpointError, CorruptCheckpoint, history

_BLOCK = 1 << 22  # bytes read at a time for a file's checksum

SHARDS = "shards"  # the run folder's folder of sharded states
_METADATA = DCP_INDEX  # DCP's index, written last (to a temporary name, then renamed)


def _cuts(learner: Any) -> dict[int, Any]:
    """Each sharded parameter's :class:`Cut`, by the parameter's ``id`` (none: replicated)."""
    sharding = getattr(learner, "sharding", None)
    if sharding is None:
        return {}
    return {id(p): sharding.cuts[name] for name, p in sharding.parameters().items()}


def _wrap(local: Tensor, cut: Any, learner: Any) -> Tensor:
    """This process's rows as a DTensor of the whole tensor: sharded over the sample axis,
    the same on every task group."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = torch.empty(cut.shape, device="meta")
    return DTensor.from_local(
        local.contiguous(),
        learner.mesh.device_mesh,
        [Replicate(), Shard(0)],
        run_check=False,
        shape=cut.shape,
        stride=full.stride(),
    )


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP on one plain process, without its warning that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        yield


def _names(algorithm: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by name, in the order of its state's indices."""
    by_id = {id(p): n for n, p in algorithm.named_parameters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _folder_name(step: int) -> str:
    """One name for every rank (rank 0's, broadcast): a new folder for every save."""
    name = [f"step-{step}-{secrets.token_hex(4)}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return f"{SHARDS}/{name[0]}"


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _everyones(mine: dict[str, Any]) -> dict[str, Any]:
    """The union of every process's ``mine`` (a collective), on every process."""
    if not dist.is_initialized():
        return dict(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _share(names: list[str]) -> list[str]:
    """This process's share of ``names`` (all of them on one process)."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _checksums(folder: Path) -> dict[str, int]:
    """The CRC-32 of every file of ``folder``, as rank 0 lists it; each process reads its
    share (a collective)."""
    names = [sorted(p.name for p in folder.iterdir() if p.is_file())]
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    return _everyones({n: _file_crc32(folder / n) for n in _share(names[0])})


def verify(checkpoint: Path, state: Mapping[str, Any]) -> None:
    """Check the files of the sharded state a checkpoint's dict ``state`` (read from
    ``checkpoint``) names against their checksums, each process its share; every process
    calls it, and all raise alike (a collective). Nothing to check for a checkpoint with whole
    tensors, or one written before sharded states had checksums.

    Raises:
        CorruptCheckpoint: a file is missing or fails its checksum.
    """
    record = state.get("sharded")
    if not isinstance(record, Mapping) or not isinstance(record.get("checksums"), Mapping):
        return
    folder = Path(checkpoint).parent / record["folder"]
    sums = record["checksums"]
    failed: dict[str, str] = {}
    for name in _share(sorted(sums)):
        try:
            if _file_crc32(folder / name) != sums[name]:
                failed[name] = "fails its checksum"
        except OSError as e:
            failed[name] = f"cannot be read ({e.strerror or e})"
    failed = _everyones(failed)
    if failed:
        said = ", ".join(f"{name} {why}" for name, why in sorted(failed.items()))
        raise CorruptCheckpoint(
            f"checkpoint {checkpoint} names its sharded state {folder}, in which {said}: "
            "its bytes changed after they were written"
        )


def save(
    out: Path,
    step: int,
    algorithm: nn.Module,
    optimizer: torch.optim.Optimizer,
    learner: Any,
) -> dict[str, Any]:
    """Write the model's and the optimizer's tensors as this process holds them (every
    process calls it: a collective); return the record the checkpoint file keeps: the
    folder, the optimizer's settings, the parameters' names and the checksums of the
    folder's files."""
    import torch.distributed.checkpoint as dcp

    cuts = _cuts(learner)
    state: dict[str, Tensor] = {}
    for key, t in algorithm.state_dict(keep_vars=True).items():
        value = t.detach()
        state[f"model/{key}"] = _wrap(value, cuts[id(t)], learner) if id(t) in cuts else value
    names = _names(algorithm, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = optimizer.state_dict()
    others: dict[int, dict[str, Any]] = {}  # entries that are not tensors
    for index, entry in saved["state"].items():
        p = params[index]
        for k, v in entry.items():
            if not isinstance(v, Tensor):
                others.setdefault(index, {})[k] = v
                continue
            key = f"optimizer/{names[index]}/{k}"
            shaped = id(p) in cuts and v.dim() > 0 and v.shape == p.shape  # per entry
            state[key] = _wrap(v.detach(), cuts[id(p)], learner) if shaped else v.detach()
    folder = _folder_name(step)
    with _one_process():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(Path(out) / folder),
            no_dist=not dist.is_initialized(),
        )
    return {
        "folder": folder,
        "names": names,
        "optimizer": {"param_groups": saved["param_groups"], "state": others},
        "checksums": _checksums(Path(out) / folder),
    }


def load(
    out: Path,
    record: Mapping[str, Any],
    algorithm: nn.Module,
    optimizer: torch.optim.Optimizer,
    learner: Any,
) -> None:
    """Read the checkpoint ``record`` names into the model and the optimizer as this process
    holds them now, whatever the layout that wrote it (every process calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(out) / record["folder"]
    try:
        stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError, EOFError) as e:
        raise CorruptCheckpoint(f"the sharded state {folder} cannot be read ({e})") from e
    sizes = {k: m for k, m in stored.items() if isinstance(m, TensorStorageMetadata)}
    names = _names(algorithm, optimizer)
    if list(record["names"]) != names:
        raise CheckpointError(
            f"the sharded state {folder} holds the parameters of another model "
            f"({len(record['names'])} saved, {len(names)} here)"
        )
    cuts = _cuts(learner)

    def template(key: str, like: Tensor, cut: Any | None, whole: bool) -> Tensor:
        """What DCP reads ``key`` into: this process's rows of a sharded tensor, else the
        whole tensor. ``whole``: a model entry, whose shape must be the saved one."""
        if key not in sizes:
            raise CheckpointError(f"the sharded state {folder} has no {key}: another model")
        size, dtype = sizes[key].size, sizes[key].properties.dtype
        shape = cut.shape if cut is not None else like.shape
        if whole and size != shape:
            raise CheckpointError(
                f"{key} in {folder} is {tuple(size)}, here {tuple(shape)}: another model"
            )
        if cut is not None and len(size) > 0 and size == cut.shape:
            return _wrap(
                torch.zeros(cut.local_shape, dtype=dtype, device=like.device), cut, learner
            )
        return torch.zeros(size, dtype=dtype, device=like.device if len(size) else "cpu")

    model = algorithm.state_dict(keep_vars=True)
    state = {
        f"model/{k}": template(f"model/{k}", t.detach(), cuts.get(id(t)), True)
        for k, t in model.items()
    }
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    wanted: dict[int, dict[str, str]] = {}
    for key in sizes:
        if not key.startswith("optimizer/"):
            continue
        name, _, k = key.removeprefix("optimizer/").rpartition("/")
        if name not in index:
            raise CheckpointError(f"the sharded state {folder} has state of {name!r}, not here")
        p = params[index[name]]
        wanted.setdefault(index[name], {})[k] = key
        state[key] = template(key, p.detach(), cuts.get(id(p)), False)
    try:
        with _one_process():
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(folder),
                no_dist=not dist.is_initialized(),
            )
    except Exception as e:  # DCP wraps a reader's failure on any rank in its own types
        raise CorruptCheckpoint(
            f"the sharded state {folder} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    with torch.no_grad():
        for k, t in model.items():
            t.copy_(_local(state[f"model/{k}"]))
    others = record["optimizer"]["state"]
    entries: dict[int, dict[str, Any]] = {}
    for i in sorted(set(wanted) | set(others)):
        entries[i] = {k: _local(state[key]) for k, key in wanted.get(i, {}).items()}
        entries[i].update(others.get(i, {}))
    optimizer.load_state_dict(
        {"state": entries, "param_groups": record["optimizer"]["param_groups"]}
    )


def cut_optimizer_state(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, learner: Any
) -> dict[str, Any]:
    """A replicated run's optimizer state (whole tensors) cut to the rows this process holds
    in a sharded one, for ``optimizer.load_state_dict``."""
    cuts = _cuts(learner)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, entry in saved["state"].items():
        cut = cuts.get(id(params[int(index)]))
        state[index] = {
            k: cut.take(v)
            if cut is not None and isinstance(v, Tensor) and v.dim() > 0 and v.shape == cut.shape
            else v
            for k, v in entry.items()
        }
    return {"state": state, "param_groups": saved["param_groups"]}


def collect(out: Path, checkpoint: Path) -> None:
    """Remove the sharded states no kept checkpoint names (older ones, and those a crash left
    before their checkpoint file was written). Rank 0, after a save."""
    kept: set[str] = set()
    for path in history(Path(checkpoint)):
        if not path.is_file():
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # unreadable: it resumes nothing, and names nothing
            continue
        record = state.get("sharded") if isinstance(state, dict) else None
        if isinstance(record, dict) and isinstance(record.get("folder"), str):
            kept.add(Path(record["folder"]).name)
    shards = Path(out) / SHARDS
    for folder in shards.iterdir() if shards.is_dir() else ():
        if folder.name not in kept:
            shutil.rmtree(folder, ignore_errors=True)
