"""What a model's forward meets inside metaddp's loops: attention with derivatives of every
order (:func:`attention`), dropout keyed by the samples (the draw scopes of ``_draws``) and the
routing between the model and them (:func:`routes`)."""

from ._attention import attention
from ._draws import (
    DrawScope,
    ForwardKey,
    batch_start,
    current_key,
    keyed_forward,
    meta_batch,
    numbered,
    reserve,
    scope_open,
    stacked_forward,
    stacked_tasks,
    task,
    unkeyed,
    unkeyed_here,
)
from ._routes import may_draw, needs_routes, routes, unkeyable_layers

__all__ = [
    "DrawScope",
    "ForwardKey",
    "attention",
    "batch_start",
    "current_key",
    "keyed_forward",
    "meta_batch",
    "may_draw",
    "needs_routes",
    "numbered",
    "reserve",
    "routes",
    "scope_open",
    "stacked_forward",
    "stacked_tasks",
    "task",
    "unkeyable_layers",
    "unkeyed",
    "unkeyed_here",
]
