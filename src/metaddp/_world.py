"""Process groups: initialisation from the launcher's environment, and the task x sample mesh.

Ranks are laid out task-major: rank = task_index * samples + sample_index. The sample axis,
which carries the collectives inside the inner loop, is innermost, so on several machines a
sample group stays on one machine as long as ``samples`` divides the processes per machine.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ._collectives import Group, group_rank, group_size

DEFAULT_TIMEOUT = timedelta(minutes=5)


def default_backend() -> str:
    """NCCL when this process has a CUDA device, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(backend: str | None = None, timeout: timedelta | float = DEFAULT_TIMEOUT) -> int:
    """Join the process group described by the launcher's environment; return the world size.

    Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) this initialises
    ``torch.distributed``; NCCL processes also select the GPU ``LOCAL_RANK``. With no launcher
    it does nothing and returns 1: every metaddp collective is then the identity, so the same
    script runs as one plain process. ``timeout`` (seconds or a timedelta) bounds how long a
    collective waits for ranks that are out of step before failing with a message.
    """
    if dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return 1
    backend = backend or default_backend()
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_world_size()


def shutdown() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return group_rank(None)


def world_size() -> int:
    return group_size(None)


@dataclasses.dataclass(frozen=True)
class Mesh:
    """How the ranks share the work of one meta-batch.

    ``tasks`` ranks hold different tasks; within each of those, ``samples`` ranks split every
    task's batch. ``tasks * samples`` must equal the world size. Give one of the two and the
    other follows; give neither and every rank splits every task's batch (sample-parallel).
    """

    tasks: int
    samples: int
    task_group: Group
    sample_group: Group
    group: Group  # every rank of the mesh: where meta-gradients are summed

    @classmethod
    def create(cls, tasks: int | None = None, samples: int | None = None) -> "Mesh":
        world = world_size()
        if tasks is None and samples is None:
            tasks, samples = 1, world
        for axis, size in (("task", tasks), ("sample", samples)):
            if size is not None and (size < 1 or world % size):
                raise ValueError(
                    f"{size} {axis} group(s) do not fit a world of {world} process(es): the "
                    f"{axis} axis must be a positive divisor of the world size"
                )
        tasks = world // samples if tasks is None else tasks
        samples = world // tasks if samples is None else samples
        if tasks * samples != world:
            raise ValueError(
                f"a mesh of {tasks} task group(s) x {samples} sample rank(s) does not fit a "
                f"world of {world} process(es): tasks * samples must equal the world size"
            )
        if world == 1:
            return cls(1, 1, None, None, None)
        # Every rank creates every subgroup, in the same order (torch.distributed requires it).
        task_group = sample_group = None
        me = rank()
        for t in range(tasks):
            ranks = [t * samples + s for s in range(samples)]
            g = dist.new_group(ranks)
            if me in ranks:
                sample_group = g
        for s in range(samples):
            ranks = [t * samples + s for t in range(tasks)]
            g = dist.new_group(ranks)
            if me in ranks:
                task_group = g
        return cls(tasks, samples, task_group, sample_group, None)

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
