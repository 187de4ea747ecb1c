"""``autocast=torch.bfloat16``: the forward passes in bfloat16, the meta-parameters, their
gradients and the reductions in float32; the meta-gradient's error against float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import metaddp as md
import reference
from metaddp.testing import scenarios as S

PROBLEMS = [S.Problem("mlp", steps=2, n_tasks=3, dtype=torch.float32),
            S.Problem("conv", steps=2, n_tasks=2, dtype=torch.float32)]


def error(p: S.Problem, autocast) -> tuple[float, set]:
    p64 = dataclasses.replace(p, dtype=torch.float64)
    _, want = reference.maml_meta_grad(p64.build_model(), p64.tasks(), steps=p.steps,
                                       inner_lr=p.inner_lr, first_order=False,
                                       classification=p.model == "conv")
    alg = md.MAML(p.build_model(), inner_lr=p.inner_lr, steps=p.steps, autocast=autocast)
    alg.meta_loss(p.tasks(), p.loss_fn).backward()
    got = S.meta_gradient(alg)
    scale = max(float(v.abs().max()) for v in want.values())
    return (max(float((got[k].double() - want[k]).abs().max()) for k in want) / scale,
            {g.dtype for g in got.values()})


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: p.model)
def test_bfloat16_forward_passes_with_float32_meta_gradients(p):
    plain, dtypes = error(p, None)
    low, dtypes_bf16 = error(p, torch.bfloat16)
    assert dtypes == dtypes_bf16 == {torch.float32}
    # float32 alone: rounding, about 1e-7 (observed 2.6e-7 and 1.5e-7). bfloat16 keeps 8
    # significant bits (relative rounding 4e-3): observed 4.1e-3 (MLP) and 5.6e-3 (conv).
    # Above 1e-4, autocast really ran; below 2e-2, no term was lost (that is 1e-1 or more).
    assert plain < 1e-6
    assert 1e-4 < low < 2e-2


def test_autocast_is_part_of_the_settings_ranks_must_share():
    a = md.MAML(PROBLEMS[0].build_model(), autocast=torch.bfloat16)
    b = md.MAML(PROBLEMS[0].build_model())
    assert a.signature() != b.signature()
    with pytest.raises(ValueError, match="autocast must be"):
        md.MAML(PROBLEMS[0].build_model(), autocast=torch.float64)
