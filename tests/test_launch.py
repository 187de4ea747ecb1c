"""run_local: ranks start from a fresh interpreter's state (forked from a server that
imported torch once, or spawned), with the caller's environment as it is at the call."""

from __future__ import annotations

import platform

import pytest
import torch

import workers
from metaddp import _host
from metaddp.distributed.launch import run_local


def test_ranks_see_the_callers_environment_now_and_nothing_else_of_it(monkeypatch):
    run_local(workers.what_a_rank_starts_with, 1)  # the server (if any) starts here
    monkeypatch.setenv("METADDP_LAUNCH_PROBE", "set after the first call")
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the caller's state: not the ranks'
    _host.begin_step()
    try:
        got = run_local(workers.what_a_rank_starts_with, 2, threads=1)
    finally:
        torch.set_default_dtype(before)
        _host.discard()
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        assert r == {"env": "set after the first call", "rank": r["rank"], "threads": 1,
                     "dtype": "torch.float32", "in_step": False}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_ranks_keep_freed_memory_for_the_next_step(monkeypatch):
    # metaddp.init keeps a freed 256 MiB block in the process (mapped again it would be
    # faulted in and zeroed at every step); with the setting off, glibc returns it at once.
    kept = run_local(workers.freed_memory_kept_mib, 1)[0]
    monkeypatch.setenv("METADDP_KEEP_FREED_MEMORY", "0")
    returned = run_local(workers.freed_memory_kept_mib, 1)[0]
    # 256 MiB written: nearly all of it stays resident (the margin: pages the allocator may
    # have reused for its own bookkeeping); returned, less than a tenth of it stays.
    assert kept > 240, kept
    assert returned < 25, returned


def test_leaving_waits_for_every_process_at_the_store_and_no_longer_than_its_bound():
    # shutdown()'s wait meets at the group's store, not in a collective that a peer one step
    # behind would take for its own (and hold until the group's 5-minute timeout).
    got = run_local(workers.meetings_at_the_store, 2, threads=1)
    for rank in got:  # both came: each meeting ends long before its 30 s bound
        assert rank["first"] < 20 and rank["second"] < 20
    assert 0.3 <= got[0]["alone"] < 20  # nobody else came: it gives up after its 0.3 s
