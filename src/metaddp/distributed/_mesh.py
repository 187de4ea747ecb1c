"""Process groups: initialisation from the launcher's environment, and the task x sample mesh.

Ranks are laid out task-major: rank = task_index * samples + sample_index. The sample axis,
which carries the collectives inside the inner loop, is innermost, so on several machines a
sample group stays on one machine as long as ``samples`` divides the processes per machine.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._allocator import keep_freed_memory
from ._collectives import Group, group_rank, group_size

DEFAULT_TIMEOUT = timedelta(minutes=5)


def default_backend() -> str:
    """NCCL when this process has a CUDA device, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(backend: str | None = None, timeout: timedelta | float = DEFAULT_TIMEOUT) -> int:
    """Join the process group described by the launcher's environment; return the world size.

    Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) this initialises
    ``torch.distributed``; NCCL processes also select the GPU ``LOCAL_RANK``. With no launcher
    it joins nothing and returns 1: every metaddp collective is then the identity, so the same
    script runs as one plain process. ``timeout`` (seconds or a timedelta) bounds how long a
    collective waits for ranks that are out of step before failing with a message.

    It also keeps freed CPU memory in the process for the next step
    (:func:`metaddp.distributed.keep_freed_memory`; ``METADDP_KEEP_FREED_MEMORY=0`` leaves it out).
    """
    keep_freed_memory()
    if backend is not None and backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            "backend='nccl' needs CUDA, and no CUDA device is available here: use "
            "backend='gloo' on the CPU (the default without CUDA: md.init())"
        )
    if dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return 1
    backend = backend or default_backend()
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
        )
    atexit.unregister(_leave_at_exit)  # once, however often a program joins and leaves
    atexit.register(_leave_at_exit)
    return dist.get_world_size()


def _leave_at_exit() -> None:
    """:func:`shutdown` at the interpreter's exit, for a program that joined with :func:`init`
    and did not leave: waiting for the others only where no exception ended it (one that
    did is in ``sys.last_value``)."""
    if dist.is_initialized():
        shutdown(wait=getattr(sys, "last_value", None) is None)


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under an elastic launcher that shares its rendezvous store with the workers, that store
    outlives a restart, and so do the keys the previous attempt's process groups wrote there:
    the restarted workers' groups then read stale addresses and fail to connect (pytorch
    #135712). A prefix per attempt keeps every attempt's keys apart. ``None`` elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"metaddp/attempt-{attempt}/", store)


def world_timeout() -> timedelta:
    """How long a collective of the default process group waits (:data:`DEFAULT_TIMEOUT` when
    it cannot be read): every group the library creates waits as long."""
    try:
        default = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        return default._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return DEFAULT_TIMEOUT


def _subgroup_options(backend: str) -> object | None:
    """Options that give a new group the default group's timeout: groups made without them
    wait torch's default (30 minutes for gloo), not the timeout given to :func:`init`."""
    cls = {
        "gloo": getattr(dist, "ProcessGroupGloo", None),
        "nccl": getattr(dist, "ProcessGroupNCCL", None),
    }.get(backend)
    if cls is None:
        return None
    options = cls._Options() if backend == "gloo" else cls.Options()
    options._timeout = world_timeout()
    return options


def shutdown(*, wait: bool = True) -> None:
    """Leave the process group (a no-op when none was joined).

    With gloo and ``wait``, on a normal exit, the processes first wait for each other at the
    group's store (not in a collective), for at most half a minute: one that tears its
    connections down while another still reads them can make that one abort ("terminate called
    without an active exception", a SIGABRT at exit, seen in about one run in six of a 2-process
    program, and in none of 24 with the wait). Called while an exception propagates
    (``finally:``), or with ``wait=False``, it leaves at once: where the others may still be
    inside a collective (a rank that stops on an error of its own), a wait would join it, and
    they learn of the error from the closed connections sooner. A program that joined with
    :func:`init` and does not call it leaves this way at exit, waiting unless an exception ended
    it."""
    if not dist.is_initialized():
        return
    try:
        if (
            wait
            and not sys.exc_info()[0]
            and dist.get_backend() == "gloo"
            and dist.get_world_size() > 1
        ):
            _meet_at_store(dist.get_world_size(), _LEAVING_S)
    except Exception:  # noqa: BLE001 (a peer gone or late: leave all the same)
        pass
    finally:
        # Pending works and their tensors freed now, not by the interpreter's teardown under
        # gloo's threads (an abort at exit: 2 of 10 quickstart runs without, 0 of 12 with).
        gc.collect()
        dist.destroy_process_group()


_LEAVING_S = 30  # the most shutdown() waits for the other processes (gloo)


def _meet_at_store(world: int, seconds: float) -> None:
    """Wait until every process has come here, at most ``seconds``: through the group's
    store, not a collective, which a peer still inside a collective (a step more than this
    one) would take for its own and wait on until the group's timeout. Each arrival adds 1
    to one counter; the processes leave at the next multiple of ``world``, so a store that
    outlives the group (an elastic agent's) serves every later meeting too."""
    store = dist.distributed_c10d._get_default_store()
    arrived = store.add(_LEAVING_KEY, 1)
    everyone = -(-arrived // world) * world
    deadline = time.monotonic() + seconds
    while store.add(_LEAVING_KEY, 0) < everyone and time.monotonic() < deadline:
        time.sleep(0.005)


_LEAVING_KEY = "metaddp/leaving"


def rank() -> int:
    return group_rank(None)


def world_size() -> int:
    return group_size(None)


LAYOUTS = ("sample", "task", "hybrid")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """How the ranks share the work of one meta-batch: a 2-D ``task x sample`` device mesh.

    ``tasks`` ranks hold different tasks; within each of those, ``samples`` ranks split every
    task's batch. ``tasks * samples`` must equal the world size. The groups come from
    ``torch.distributed.device_mesh.init_device_mesh`` with the dimension names ``"task"``
    and ``"sample"`` (:attr:`device_mesh`, ``None`` on one plain process), so the mesh
    composes with other parallelisms built on it.
    """

    tasks: int
    samples: int
    task_group: Group
    sample_group: Group
    group: Group  # every rank of the mesh: where meta-gradients are summed
    device_mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def create(cls, tasks: int | None = None, samples: int | None = None) -> Mesh:
        """The mesh with ``tasks`` task groups of ``samples`` ranks (give one or neither).

        With neither, every rank splits every task's batch (``tasks=1``, sample-parallel).
        """
        world = world_size()
        if tasks is None and samples is None:
            tasks = 1
        for axis, size in (("task", tasks), ("sample", samples)):
            if size is not None and (size < 1 or world % size):
                raise ValueError(
                    f"{size} {axis} group(s) do not fit a world of {world} process(es): the "
                    f"{axis} axis must be a positive divisor of the world size"
                )
        if tasks is None:
            assert samples is not None
            tasks = world // samples
        samples = world // tasks if samples is None else samples
        if tasks * samples != world:
            raise ValueError(
                f"a mesh of {tasks} task group(s) x {samples} sample rank(s) does not fit a "
                f"world of {world} process(es): tasks * samples must equal the world size"
            )
        if not dist.is_initialized():
            return cls(1, 1, None, None, None)
        # Ranks are laid out task-major (rank = task_index * samples + sample_index): the
        # sample axis, which carries the inner loop's collectives, is innermost, so it stays
        # on one machine when ``samples`` divides the processes per machine.
        backend = dist.get_backend()
        device_type = "cuda" if backend == "nccl" else "cpu"
        options = _subgroup_options(backend)
        dm = init_device_mesh(
            device_type,
            (tasks, samples),
            mesh_dim_names=("task", "sample"),
            backend_override=None
            if options is None
            else {dim: (backend, options) for dim in ("task", "sample")},  # type: ignore[misc]
        )
        return cls(tasks, samples, dm.get_group("task"), dm.get_group("sample"), None, dm)

    @classmethod
    def for_layout(cls, layout: str) -> Mesh:
        """The mesh of a named layout.

        ``sample``: every rank splits every task; ``task``: tasks split over ranks; ``hybrid``:
        two task groups (when the world size is even, else one), each splitting its tasks'
        samples.
        """
        world = world_size()
        if layout == "sample":
            return cls.create(tasks=1)
        if layout == "task":
            return cls.create(tasks=world)
        if layout == "hybrid":
            return cls.create(tasks=2 if world % 2 == 0 else 1)
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")

    @property
    def task_index(self) -> int:
        """Which task group this rank belongs to (0 .. tasks-1)."""
        return group_rank(self.task_group)

    @property
    def sample_index(self) -> int:
        """This rank's place within its sample group (0 .. samples-1)."""
        return group_rank(self.sample_group)

    def __repr__(self) -> str:
        return f"Mesh(tasks={self.tasks}, samples={self.samples})"
