"""Where a model's forward meets metaddp: attention with second derivatives and keyed dropout.

Inside :func:`routes`, entered by :func:`metaddp._functional.call` around every forward of a
model that may need it (:func:`needs_routes`), a ``TorchFunctionMode`` routes:

- ``F.scaled_dot_product_attention`` to :func:`metaddp.forward.attention`, exact, with
  derivatives of every order and memory linear in the sequence length (PyTorch's fused
  kernels have no double backward, so second-order MAML through them fails);
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.Transformer*``) to the
  same, for its common form (no ``bias_k``/``bias_v``, ``add_zero_attn`` or static keys: those
  run PyTorch's math path, without dropout);
- ``F.dropout`` and ``F.dropout1d/2d/3d`` to masks keyed by the forward (``_draws``): the
  same on any number of processes;
- the draws that cannot be keyed (``alpha_dropout``, ``feature_alpha_dropout``, ``rrelu``) to
  an error inside metaddp's loops.

Outside a draw scope (a forward the user runs alone) dropout stays PyTorch's. Under
``torch.vmap`` (stacked tasks, deterministic mode's chunks) attention is written out in plain
operations, which vmap batches and autograd differentiates to any order, and dropout draws
each stacked task's or chunk's own keyed masks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from . import _draws
from ._attention import attention

_DROPOUTS = {F.dropout: False, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True}
_UNKEYABLE = {
    F.alpha_dropout: "alpha_dropout",
    F.feature_alpha_dropout: "feature_alpha_dropout",
    F.rrelu: "rrelu",
}


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    try:
        bound = _signature(func).bind(*args, **kwargs)
    except TypeError:  # a wrong call: PyTorch's own error says what is wrong
        return None
    bound.apply_defaults()
    return bound.arguments


@functools.cache
def _signature(func: Any) -> inspect.Signature:
    if func is F.scaled_dot_product_attention:
        return inspect.signature(_sdpa_signature)
    return inspect.signature(func)


def _sdpa_signature(  # noqa: ANN202
    query,  # noqa: ANN001
    key,  # noqa: ANN001
    value,  # noqa: ANN001
    attn_mask=None,  # noqa: ANN001
    dropout_p=0.0,  # noqa: ANN001
    is_causal=False,  # noqa: ANN001
    scale=None,  # noqa: ANN001
    enable_gqa=False,  # noqa: ANN001
):
    pass


def _transformed(*tensors: Any) -> bool:
    """Whether any tensor is wrapped by a functorch transform (``vmap``, ``grad``)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(isinstance(t, Tensor) and wrapped(t) for t in tensors)


def _dropout(func: Any, a: dict[str, Any], feature: bool) -> Tensor | None:
    x, p, training = a["input"], float(a["p"]), bool(a["training"])
    if not training or p == 0.0:
        return x
    what = f"F.{func.__name__}(p={p})"
    key = _draws.current_key(what)
    if key is None:
        return None
    return x * _draws.dropout_mask(key, x, p, feature, what)


def _sdpa(a: dict[str, Any]) -> Tensor:
    q, k, v, p = a["query"], a["key"], a["value"], float(a["dropout_p"])
    rest = {n: a[n] for n in ("attn_mask", "is_causal", "scale", "enable_gqa")}
    if _transformed(q, k, v, a["attn_mask"]):
        # Under torch.vmap (stacked tasks): attention written out, which vmap batches and
        # autograd differentiates to any order, with each task's keyed mask.
        key = _draws.current_key(f"attention dropout (p={p})") if p > 0 else None
        if p > 0 and key is None:  # PyTorch's own draw: vmap refuses it, and says so
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **rest)
        shape = (*q.shape[:-1], k.shape[-2])
        keep = None if key is None else _draws.attention_keep(key, shape, p, q.dtype, q.device)
        return _written_out(q, k, v, keep=keep, **rest)
    keep = None
    if p > 0:
        key = _draws.current_key(f"attention dropout (p={p})")
        if key is None:  # outside metaddp's loops: PyTorch's own draw, on its math path
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **rest)
        shape = (*q.shape[:-1], k.shape[-2])
        keep = _draws.attention_keep(key, shape, p, q.dtype, q.device)
    return attention(q, k, v, dropout_p=p, dropout_keep=keep, **rest)


def _written_out(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    keep: Any,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s definition in plain operations, the dropout
    multiplier ``keep(rows)`` applied to the probabilities."""
    length, source = q.shape[-2], k.shape[-2]
    if enable_gqa and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if keep is not None:
        weights = weights * keep(slice(None))
    return weights @ v


def _multi_head(a: dict[str, Any]) -> Any:
    """``F.multi_head_attention_forward`` in its common form, on :func:`attention` (PyTorch's
    own steps, with the samples kept first where dropout is keyed)."""
    query, key, value = a["query"], a["key"], a["value"]
    if (
        a["bias_k"] is not None
        or a["bias_v"] is not None
        or a["add_zero_attn"]
        or a["static_k"] is not None
        or a["static_v"] is not None
        or query.dim() != 3
    ):
        return NotImplemented
    length, n, embed = query.shape
    heads = int(a["num_heads"])
    head = embed // heads
    if a["use_separate_proj_weight"]:
        bias = a["in_proj_bias"]
        bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3)
        proj = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
        q, k, v = F._in_projection(query, key, value, *proj, bq, bk, bv)  # type: ignore[attr-defined]
    else:
        packed = F._in_projection_packed  # type: ignore[attr-defined]
        q, k, v = packed(query, key, value, a["in_proj_weight"], a["in_proj_bias"])
    attn_mask, is_causal, need = a["attn_mask"], bool(a["is_causal"]), bool(a["need_weights"])
    padding = F._canonical_mask(
        mask=a["key_padding_mask"],
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
            "module method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and padding is None and not need:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if padding is not None:
            is_causal = False
    source = k.shape[0]
    # [L, N, E] -> [N, H, L, E/H]: the samples first, so that keyed dropout finds them.
    q = q.reshape(length, n, heads, head).permute(1, 2, 0, 3)
    k = k.reshape(source, n, heads, head).permute(1, 2, 0, 3)
    v = v.reshape(source, n, heads, head).permute(1, 2, 0, 3)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.reshape(n, heads, length, source) if attn_mask.dim() == 3 else attn_mask
    if padding is not None:
        pad = padding.reshape(n, 1, 1, source)
        mask = pad if mask is None else mask + pad
    p = float(a["dropout_p"]) if a["training"] else 0.0
    if need:
        scores = q @ k.transpose(-2, -1) * head**-0.5
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if p > 0:
            key_ = _draws.current_key(f"nn.MultiheadAttention dropout (p={p})")
            if key_ is None:
                weights = F.dropout(weights, p=p)
            else:
                keep = _draws.attention_keep(key_, tuple(weights.shape), p, q.dtype, q.device)
                weights = weights * keep(slice(None))
        out = weights @ v
    else:
        out = _sdpa(
            {
                "query": q,
                "key": k,
                "value": v,
                "attn_mask": mask,
                "dropout_p": p,
                "is_causal": is_causal,
                "scale": None,
                "enable_gqa": False,
            }
        )
        weights = None
    out = out.permute(2, 0, 1, 3).reshape(length * n, embed)
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"]).reshape(length, n, embed)
    if weights is None:
        return out, None
    if a["average_attn_weights"]:
        return out, weights.mean(dim=1)
    return out, weights


class _Routes(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            a = _bound(func, args, kwargs)
            if a is not None:
                out = _dropout(func, a, _DROPOUTS[func])
                if out is not None:
                    return out
        elif func is F.scaled_dot_product_attention:
            a = _bound(func, args, kwargs)
            if a is not None:
                return _sdpa(a)
        elif func is F.multi_head_attention_forward:
            a = _bound(func, args, kwargs)
            if a is not None:
                out = _multi_head(a)
                if out is not NotImplemented:
                    return out
                if a["training"] and float(a["dropout_p"]) > 0:
                    _draws.current_key("nn.MultiheadAttention with bias_k, bias_v or static keys")
                with sdpa_kernel(SDPBackend.MATH):
                    return func(*args, **kwargs)
        elif func in _UNKEYABLE:
            a = _bound(func, args, kwargs)
            if a is not None and a["training"] and (func is F.rrelu or float(a["p"]) > 0):
                if _draws._SCOPE.get() is not None:
                    raise ValueError(
                        f"F.{_UNKEYABLE[func]} draws random numbers that metaddp does not key "
                        "to samples (only dropout and dropout1d/2d/3d are keyed), so the "
                        "meta-gradient would change with the number of processes: call .eval() "
                        "on the layer or replace it"
                    )
        return func(*args, **kwargs)


# torch.nn's own layers that never call what the routing sees.
_ROUTED = (
    nn.modules.dropout._DropoutNd,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.RReLU,
)
_TOKENS = ("dropout", "attention", "rrelu", "multi_head")
# What else a forward's source may draw with (torch.randn, torch.bernoulli, np.random, a
# generator): hooked outside metaddp's loops (metaddp.distributed), not routed.
_DRAWS = ("rand", "bernoulli", "normal_", "torch.normal", "multinomial", "poisson", "generator")


@functools.cache
def _forward_may_route(cls: Any, tokens: tuple[str, ...] = _TOKENS) -> bool:
    """Whether a module class's ``forward`` may call what the routing sees (or what
    ``tokens`` name): torch.nn's own layers by their type, any other by its source (no
    source: assume it may)."""
    if issubclass(cls, _ROUTED):
        return True
    if cls.__module__.startswith("torch.nn."):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return True
    return any(token in source.lower() for token in tokens)


def may_draw(module: nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` may draw or call attention (its type: torch.nn's
    dropout and attention layers; any other by its source: dropout, attention, or a call
    such as ``torch.randn``)."""
    return _forward_may_route(cast(Any, type(module)), _TOKENS + _DRAWS)


def needs_routes(model: nn.Module) -> bool:
    """Whether a forward of ``model`` may call attention or draw: only then is the routing
    entered (it sees every torch call in Python, a cost for small models)."""
    return any(_forward_may_route(cast(Any, type(m))) for m in model.modules())


def routes(model: nn.Module, needed: bool | None = None) -> contextlib.AbstractContextManager:
    """The routing around one forward of ``model`` (module docstring), where it may be needed
    (``needed``: :func:`needs_routes` of ``model``, where the caller knows it already)."""
    if needed is None:
        needed = needs_routes(model)
    return _Routes() if needed else contextlib.nullcontext()


def unkeyable_layers(model: nn.Module) -> list[str]:
    """Layers in training mode whose draws metaddp cannot key to samples: alpha dropout and
    RReLU, and torch's attention layers with dropout whose samples are not first."""
    found = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        label = f"{name or 'the model'} ({type(m).__name__})"
        if isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout)) and m.p > 0:
            found.append(f"{label}: alpha dropout is not keyed")
        elif isinstance(m, nn.RReLU):
            found.append(f"{label}: RReLU's random slopes are not keyed")
        elif isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            if not m.self_attn.batch_first and any(
                isinstance(d, nn.Dropout) and d.p > 0 for d in m.modules()
            ):
                found.append(f"{label}: dropout on a sequence-first layer (batch_first=False)")
    return found
