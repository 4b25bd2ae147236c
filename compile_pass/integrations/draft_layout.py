"""What an engine's draft model holds for its input projection, read the same way for every
engine: an unquantized ``fc`` (its weight and bias) and RMSNorm modules (its norms).

Engine plugins (``sglang_projection``, ``vllm_projection``) find where their engine keeps
these; this module says whether each fits ``compile_pass.DraftProjection``, and why not.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = ["plain_fc", "column_shard", "is_rms_norm", "not_rms_norm"]


def plain_fc(fc: Any) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], str]:
    """(weight, bias, "") of an unquantized linear computing ``x @ weight.T + bias`` and
    returning only that (``nn.Linear``, or an engine's linear whose quantization method is
    ``UnquantizedLinearMethod``), narrower than its input (the rule ``fuse_projection``
    applies to the graph's fc); else (None, None, why not). Refused, as not verified: a
    LoRA wrapper (its adapters add to the output), ``skip_bias_add`` (the bias returned
    apart), a weight whose shape is not the ``[output_size, input_size]`` the linear
    declares (re-laid after loading)."""
    weight = getattr(fc, "weight", None)
    if getattr(fc, "base_layer", None) is not None or "lora" in type(fc).__name__.lower():
        return None, None, f"its fc ({type(fc).__name__}) is wrapped for LoRA: its adapters add to fc's output"
    if getattr(fc, "skip_bias_add", False):
        return None, None, f"its fc ({type(fc).__name__}) returns its bias apart (skip_bias_add)"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None, None, f"its fc ({type(fc).__name__}) has no 2-D weight"
    method = getattr(fc, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return None, None, f"its fc is quantized ({type(method).__name__})"
    if not weight.dtype.is_floating_point or weight.element_size() < 2:
        return None, None, f"its fc weight is {weight.dtype} (quantized)"
    sharded = column_shard(fc, weight)
    if sharded:
        return None, None, sharded
    declared = (getattr(fc, "output_size", None), getattr(fc, "input_size", None))
    if all(isinstance(d, int) for d in declared) and tuple(weight.shape) != declared:
        return None, None, (f"its fc's weight is {tuple(weight.shape)}, not the [{declared[0]}, {declared[1]}] its "
                            f"{type(fc).__name__} declares (a row shard, or re-laid after loading)")
    if weight.shape[0] == weight.shape[1]:
        return None, None, (f"its fc is square ({weight.shape[1]} -> {weight.shape[0]}): the projected input "
                            f"would be as wide as the packed captures, nothing to save")
    if weight.shape[0] > weight.shape[1]:
        return None, None, (f"its fc is no narrower than the concat ({weight.shape[1]} -> {weight.shape[0]}): "
                            f"its accumulator would be larger than the packed buffer, projecting saves nothing")
    bias = getattr(fc, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None, ""


def column_shard(fc: Any, weight: torch.Tensor) -> str:
    """Why ``fc`` holds only this rank's rows of the projection (a column-parallel linear
    that does not gather its output, as SGLang's Kimi-K2.5 Eagle3 draft builds it: each rank
    ``[H_draft/tp, K*H]``, the draft all-gathers after ``fc``); "" for a whole weight. The
    plugins project with the whole ``fc`` only: a shard would hand the draft
    ``[T, H_draft/tp]``."""
    total = getattr(fc, "output_size", None)
    tp_size = getattr(fc, "tp_size", 1)
    gathers = getattr(fc, "gather_output", True)
    if isinstance(total, int) and total != weight.shape[0]:
        return (f"its fc ({type(fc).__name__}) holds {weight.shape[0]} of its {total} output rows on this rank "
                f"(column-parallel{'' if gathers else ', gather_output=False'}): the draft gathers after fc")
    if gathers is False and isinstance(tp_size, int) and tp_size > 1:
        return (f"its fc ({type(fc).__name__}) is column-parallel over {tp_size} ranks with gather_output=False: "
                f"this rank holds a shard of the projection")
    return ""


def is_rms_norm(norm: Any) -> bool:
    """Whether ``norm`` is an RMSNorm module: a 1-D ``weight``, a float eps
    (``variance_epsilon`` or ``eps``) and "rms" in its class name."""
    return (isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.dim() == 1
            and isinstance(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)), float)
            and "rms" in type(norm).__name__.lower())


def not_rms_norm(norms: Any) -> str:
    """Why the draft's norms before ``fc`` (an iterable, ``None`` entries skipped) do not fit:
    the first that is not an RMSNorm, named; "" when all are."""
    for norm in norms:
        if norm is not None and not is_rms_norm(norm):
            return f"its norm before fc is a {type(norm).__name__}, not an RMSNorm"
    return ""
