"""CapturedStep without a GPU: what recording asks of the step (no host read; its checks kept
for each replay), the errors that stop a wrong replay, and .grad after a replay.

The replay itself needs CUDA: benchmarks/device_check.py's ``graphs`` section trains with it
against eager on the device (BENCHMARKS.md has its numbers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import metaddp as md
from metaddp import _host
from metaddp.distributed import Mesh, _graphs
from metaddp.testing import scenarios as S

P = S.Problem("mlp", steps=2, dtype=torch.float32)


def test_a_recorded_step_reads_nothing_and_keeps_its_checks_for_the_replay():
    for wrapped in (False, True):
        alg = P.build_algorithm()
        learner = md.MetaDDP(alg, Mesh.for_layout("sample")) if wrapped else alg
        tasks = learner.shard(P.n_tasks, P.task) if wrapped else P.tasks()
        with _host.as_on_a_device(), _host.counting() as reads, _host.capturing():
            learner.meta_loss(tasks, P.loss_fn).backward()
            ends_in_sync = _host.in_step()
            checks = _host.take()
        assert reads.reads == 0
        # One finite check per inner step, and for an algorithm alone one of its meta-loss
        # (under MetaDDP that value rides in the gradient SUM instead); a MetaDDP step ends
        # in sync_grads, an algorithm's at the end of meta_loss.
        assert len(checks) == P.steps + (not wrapped) and ends_in_sync == wrapped
        _host.judge(checks)  # finite: passes
        if wrapped:
            _host.resume(checks)
            learner.sync_grads()
            assert not _host.in_step()
            learner.release()


def test_a_replayed_check_fails_as_the_eager_one_does():
    bad = dataclasses.replace(P, inner_lr=1e30)  # the second inner gradient overflows
    alg = bad.build_algorithm()
    with _host.as_on_a_device(), _host.capturing():
        alg.meta_loss(bad.tasks(), bad.loss_fn)  # no error while recording
        checks = _host.take()
    with pytest.raises(FloatingPointError, match=r"inner step 1: the gradient of '0\.weight'"):
        _host.judge(checks)
    learner = md.MetaDDP(bad.build_algorithm(), Mesh.for_layout("sample"))
    _host.resume(checks)
    with pytest.raises(FloatingPointError, match="inner step 1"):
        learner.sync_grads()
    assert not _host.in_step()
    learner.release()


def test_a_host_read_while_recording_is_named():
    with _host.capturing(), pytest.raises(_host.CaptureError, match="cannot record"):
        _host.read(torch.ones(2))
    _host.discard()


def test_what_cannot_be_recorded_says_why():
    alg = P.build_algorithm()
    with pytest.raises(ValueError, match="at least 1"):
        md.CapturedStep(alg, P.loss_fn, warmup=0)
    with pytest.raises(ValueError, match="CUDA device"):
        md.CapturedStep(alg, P.loss_fn)(P.tasks())  # CPU tensors
    learner = md.MetaDDP(P.build_algorithm(), Mesh.for_layout("sample"), check=True)
    with pytest.raises(RuntimeError, match="check mode"):
        md.CapturedStep(learner, P.loss_fn)
    learner.release()


def test_the_recorded_shapes_are_compared_and_described():
    tasks = P.tasks()
    _, recorded = _graphs._flatten(tasks)
    assert _graphs._flatten(P.tasks())[1] == recorded  # the same shapes again
    fewer = _graphs._flatten(tasks[:-1])[1]
    other = dataclasses.replace(P, n_support=P.n_support + 1)
    longer = _graphs._flatten(other.tasks())[1]
    assert fewer != recorded and longer != recorded
    assert _graphs._describe(recorded).startswith(f"{len(tasks)} task(s), the first's support x")
    batch = md.MetaBatch(tasks, len(tasks), range(len(tasks)))
    shifted = md.MetaBatch(tasks, len(tasks) + 1, range(1, len(tasks) + 1))
    assert _graphs._flatten(batch)[1] != _graphs._flatten(shifted)[1]
    # The substitute tasks read the given tensors, in order, and keep the meta-batch.
    tensors, _ = _graphs._flatten(batch)
    copies = [t.clone() for t in tensors]
    again = _graphs._substitute(batch, copies)
    assert isinstance(again, md.MetaBatch) and (again.n, again.indices) == (batch.n, batch.indices)
    assert all(a is b for a, b in zip(_graphs._flatten(again)[0], copies, strict=True))


def test_a_replay_sets_or_adds_to_grad_as_backward_does():
    w, v, u = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    v.grad = torch.full((3,), 10.0)
    buffers = [torch.ones(3), torch.full((3,), 2.0), None]  # u: no gradient this step
    _graphs._deliver([w, v, u], buffers)
    assert torch.equal(w.grad, torch.ones(3)) and w.grad is not buffers[0]  # a copy
    assert torch.equal(v.grad, torch.full((3,), 12.0))
    assert u.grad is None


def test_what_a_replay_would_run_stale_is_noticed():
    # Settings and train/eval mode are compared before every replay: a changed inner
    # learning rate would otherwise run the recorded one.
    for wrapped in (False, True):
        alg = P.build_algorithm()
        learner = md.MetaDDP(alg, Mesh.for_layout("sample")) if wrapped else alg
        step = md.CapturedStep(learner, P.loss_fn)
        recorded = step._settings()
        assert "'inner_lr', 0.1" in recorded[0]
        assert step._settings() == recorded
        alg.inner_lr = 0.2
        assert step._settings() != recorded
        alg.inner_lr = 0.1
        learner.eval()
        assert step._settings() != recorded
        learner.train()
        assert step._settings() == recorded
        if wrapped:
            learner.release()


SCHEDULED = ("mamlpp",)  # no host read, and not recorded: its step's graph changes


def test_the_algorithms_a_run_may_record_read_nothing_on_the_host():
    from metaddp.algorithms import SUPPORTS
    from metaddp.testing.dispatch import DispatchCounter

    for name, supports in SUPPORTS.items():
        model = "conv" if name in ("protonet", "protomaml") else "mlp"  # these need classes
        p = S.Problem(model, steps=2, algorithm=name, dtype=torch.float32)
        with _host.as_on_a_device(), _host.capturing(), DispatchCounter() as ops:
            p.build_algorithm().meta_loss(p.tasks(), p.loss_fn).backward()
            _host.take()
        # No .item()-like operation while recording, except where the class declares it
        # cannot be recorded: iMAML's conjugate gradient reads its residual at every
        # iteration (so --cuda-graphs refuses it). MAML++ reads nothing, but its step's graph
        # changes with its schedule (first order, then second), so it is not recorded.
        reads = not supports.capture and name not in SCHEDULED
        assert (ops.host_reads > 0) == reads, (name, ops.host_reads)
    assert [n for n, s in SUPPORTS.items() if not s.capture] == ["imaml", *SCHEDULED]
