"""What a checked step computed, as one row per rank, and the verdicts read from all rows.

Before the sum of a checked step, every rank writes one row of numbers about the work it did
that no earlier check saw, and the rows are gathered over the mesh (one SUM of a block, each
rank filling its own row and adding to its sample group's slot). Every rank then reads the
same rows and reaches the same verdict, so all raise together and none is left waiting in
the next collective.

Each rank's row holds:

- the rank's sample group (the ranks that split the same tasks' samples) and whether its
  record of shares is unsure (some dropped, or another learner's step was under way);
- the shares the caller made with ``md.share`` whose backward ran (:class:`Logged`): how
  many, a CRC of where each was made and one of their global sizes, in the order they were
  made; for shares of a :class:`metaddp.Batch`, the samples held per global size;
- up to :data:`PRINTS` loss-function prints (:func:`metaddp._share.loss_print`);

and each sample group's slot, the sum over its ranks of the first :data:`PLACES` shares'
global sizes and samples held, place by place.

The verdicts (the shares' in check mode only, see ``StepGuards.work_agrees``):

- *prints*: ranks that printed the same function on inputs of the same shapes (the print's
  digest) get the same numbers; another loss, or a weight read per rank, does not;
- *sizes*: where the ranks of a sample group made shares at the same call sites in the same
  order, the shares at each place are of the same global size (a rank's own count
  ``len(x)`` differs by rank on an uneven split), and its ranks hold no more samples of it
  than that size (an own count on an even split, or every rank sharing the same samples).
  Ranks that each skip a *different* task's share at one call site, as many each, line
  their places up wrongly: a correct program can be refused, so these are check mode's;
- *parts*: a sample group's shares of batches of ``n`` samples hold ``n`` samples in all, or
  a multiple (several batches of that size, chunked or not). Shares of a count are left out:
  a masked loss over the whole batch's count (``md.share(l[mask], n)``) rightly holds fewer.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

from .._share import Logged

KEYS = 6  # global sizes of shares of batches, per rank; more: the parts are not compared
PLACES = 32  # shares compared place by place, at most
PRINTS = 4  # loss-function prints compared, at most
_HEAD = 6  # group, unsure, count, sites, sizes, keys overflowed
_PRINT_AT = _HEAD + 2 * KEYS
_PRINTED = 4  # a print's numbers: its place, then the print (two sums, a digest)
_CALL = 16  # a print's place: its meta_loss call (0: outside one) * _CALL + its order there
WIDTH = _PRINT_AT + 1 + _PRINTED * PRINTS  # a rank's row
SLOT = 2 * PLACES  # a sample group's sums: each place's global size and samples held


def work_block(
    rank: int,
    world: int,
    group: int,
    groups: int,
    shares: Sequence[Logged],
    unsure: bool,
    prints: Sequence[tuple[int, Tensor]],
    device: torch.device,
) -> Tensor:
    """This rank's part of the step's block (float64, on ``device``): its row at ``rank`` of
    ``world`` rows, then its places' sizes and samples held in its sample group's slot
    (``group`` of ``groups``), zeros elsewhere. The SUM of every rank's block holds every
    row, and each group's sums place by place."""
    sites = zlib.crc32(",".join(str(s.site) for s in shares).encode())
    sizes = zlib.crc32(",".join(str(s.made.n) for s in shares).encode())
    parts: dict[int, int] = {}
    for s in shares:
        if s.made.source != "count":
            parts[s.made.n] = parts.get(s.made.n, 0) + s.made.held
    head = [group, float(unsure), len(shares), sites, sizes, float(len(parts) > KEYS)]
    keyed = [v for n in sorted(parts)[:KEYS] for v in (n, parts[n])]
    row = head + keyed + [0] * (2 * KEYS - len(keyed)) + [min(len(prints), PRINTS)]
    placed = [v for s in shares[:PLACES] for v in (s.made.n, s.made.held)]
    block = torch.zeros(world * WIDTH + groups * SLOT, dtype=torch.float64)
    block[rank * WIDTH : rank * WIDTH + len(row)] = torch.tensor(row, dtype=torch.float64)
    at = world * WIDTH + group * SLOT
    block[at : at + len(placed)] = torch.tensor(placed, dtype=torch.float64)
    block = block.to(device)
    if prints:  # left on the device: read with the block, after the collective
        places: list[int] = []
        seen: dict[int, int] = {}  # a print's place: its meta_loss call (or 0), its order there
        for call, _ in prints[:PRINTS]:
            seen[call] = seen.get(call, -1) + 1
            places.append(call * _CALL + seen[call])
        printed = torch.stack(
            [
                torch.cat(
                    [p.new_tensor([place], dtype=torch.float64), p.to(torch.float64).reshape(3)]
                )
                for place, (_, p) in zip(places, prints[:PRINTS], strict=True)
            ]
        ).to(device)
        start = rank * WIDTH + _PRINT_AT + 1
        block[start : start + printed.numel()] = printed.reshape(-1)
    return block


def judge(block: Tensor, world: int, alone: str) -> str | None:
    """The first mistake the summed block shows (the same block gives the same answer on
    every rank), or ``None``. ``alone``: the error for a part of a batch whose other parts
    no rank holds, with ``{held}`` and ``{n}`` to fill in."""
    values = block.tolist()
    table = [values[r * WIDTH : (r + 1) * WIDTH] for r in range(world)]
    if _prints_differ(table):
        return LOSS_DIFFERS
    groups: dict[int, list[list[float]]] = {}
    for r in table:
        groups.setdefault(int(r[0]), []).append(r)
    for g, members in groups.items():
        if not any(r[1] for r in members):
            at = world * WIDTH + g * SLOT
            found = _shares_wrong(members, values[at : at + SLOT], alone)
            if found:
                return found
    return None


LOSS_DIFFERS = (
    "the ranks' loss functions compute different losses: on the same made-up predictions and "
    "targets, a loss function given to metaddp returns other values on some ranks (another "
    "loss, or a weight or setting read per rank, from a node's own config?). Give every rank "
    "the same loss function with the same settings"
)


def _prints_differ(table: list[list[float]]) -> bool:
    """Whether two ranks printed a loss function at the same place, on inputs of the same
    shapes, and got numbers further apart than rounding may put them: the same function on
    the same made-up inputs rounds alike on every rank of one kind of device, and 1e-6 of the
    print leaves room for float32 kernels that block their sums otherwise. A place is the
    step's ``k``-th meta_loss over global tasks and the order of first calls in it (compared
    over the mesh: one function serves every task), or, for calls outside (``adapt``, a
    meta_loss over a rank's own list), the order of first calls there, compared within a
    sample group only (task groups run other tasks, which may have losses of their own)."""
    first: dict[tuple[float, ...], list[float]] = {}
    for r in table:
        for i in range(int(r[_PRINT_AT])):
            at = _PRINT_AT + 1 + _PRINTED * i
            place, numbers, digest = r[at], r[at + 1 : at + 3], r[at + 3]
            key = (place, digest) if place >= _CALL else (r[0], place, digest)
            seen = first.setdefault(key, numbers)
            if any(
                abs(b - a) > 1e-6 * max(1.0, abs(a), abs(b))
                for a, b in zip(seen, numbers, strict=True)
            ):
                return True
    return False


def _shares_wrong(members: list[list[float]], placed: list[float], alone: str) -> str | None:
    """The verdict on one sample group's shares (see the module docstring): its members'
    rows, and its places' sizes and samples held, summed over its members."""
    count, sites = members[0][2], members[0][3]
    aligned = len(members) > 1 and count > 0
    aligned = aligned and all(r[2] == count and r[3] == sites for r in members)
    if aligned and any(r[4] != members[0][4] for r in members):
        return (
            f"the {len(members)} ranks that split a task's samples gave md.share different "
            "global sample counts at the same place: a count of a rank's own samples "
            "(md.share(l, len(x))) is different on every rank. Pass md.share(per_sample, "
            "batch), with the Batch the losses come from, or the whole batch's size"
        )
    if aligned:  # every member holds the same size at each place
        for i in range(min(int(count), PLACES)):
            n, held = placed[2 * i] / len(members), placed[2 * i + 1]
            if held > n:
                return (
                    f"the {len(members)} ranks that split a task's samples each made "
                    f"md.share(losses, {int(n)}) at the same place, and hold {int(held)} "
                    f"samples of it in all, more than its {int(n)}: each counted its own "
                    "samples as the whole batch (md.share(l, len(x)), or a Batch.split of the "
                    "rank's own part), or every rank shared the same samples. Pass "
                    "md.share(per_sample, batch), with the Batch the losses come from "
                    "(learner.shard cuts the parts). A share is a mean over samples: for a "
                    "sum use l.sum(), for a mean of shares add them and divide"
                )
    if any(r[5] for r in members):
        return None
    parts: dict[float, float] = {}
    for r in members:
        for k in range(KEYS):
            n, held = r[_HEAD + 2 * k], r[_HEAD + 2 * k + 1]
            if n > 0:
                parts[n] = parts.get(n, 0.0) + held
    for n, held in sorted(parts.items()):
        if held % n:
            if len(members) == 1:
                return alone.format(held=int(held), n=int(n))
            return (
                f"shares of batches of {int(n)} samples hold {int(held)} samples in all over "
                f"the {len(members)} ranks that split them, not {int(n)} (or a multiple, for "
                "several such batches): each rank's share must be of its own part of the "
                "same batch, and the parts must add up to it. Cut parts with learner.shard "
                "(or Batch.split(x, y, learner.mesh.sample_index, learner.mesh.samples)) and "
                "pass md.share(per_sample, batch)"
            )
    return None
