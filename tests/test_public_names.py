"""The top level a user holds: what a training script names, at most 30 names; everything else
in a sub-namespace, and the old top-level names still there for one release, with a warning
that names the new place."""

import importlib
import warnings

import pytest

import metaddp as md


def test_the_top_level_is_short_and_every_name_resolves():
    assert len(md.__all__) <= 30
    for name in md.__all__:
        assert getattr(md, name) is not None
    assert {"inner", "bilevel", "functional", "data", "distributed"} <= set(dir(md))


@pytest.mark.parametrize("name", sorted(md._MOVED))
def test_a_moved_name_warns_and_is_the_same_object(name):
    where = md._MOVED[name]
    with pytest.warns(DeprecationWarning, match=f"metaddp.{name} is now {where}.{name}"):
        old = getattr(md, name)
    assert old is getattr(importlib.import_module(where), name)


def test_an_unknown_name_is_an_attribute_error_and_new_names_do_not_warn():
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        md.nonesuch  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        md.inner.sgd, md.bilevel.Neumann, md.functional.call, md.data.shard  # noqa: B018
        md.distributed.counting, md.algorithms.Supports  # noqa: B018
