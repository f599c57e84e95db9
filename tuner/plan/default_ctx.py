"""The context a plan is made for when the user names none: the model's trained context is a ceiling, not a default
(262,144 for Qwen3.5-35B-A3B, which few machines hold and few users run). The largest context that fits, as llama.cpp's
own ``--fit`` keeps an unset ``-c`` where it can and shrinks it where it cannot."""

from __future__ import annotations

from dataclasses import replace

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.plan.placement import largest_fitting_ctx
from tuner.plan.pricing import Price

# The least context llama.cpp's --fit shrinks an unset -c to (common/arg.cpp ``--fit-ctx``, default 4096).
FIT_CTX_MIN = 4096


def default_ctx(model: ModelInfo, base: LaunchConfig, hw: Hardware, price: Price | None = None) -> tuple[int, str]:
    """The context a plan without ``-c`` is made for, and the sentence that says so. The model's trained context is
    a ceiling, not a default: the largest context that fits ``base`` on ``hw`` (the trained one where it fits, as
    llama.cpp's own --fit keeps an unset -c), else llama.cpp's least, 4096, where none fits."""
    largest, _ = largest_fitting_ctx(model, replace(base, ctx=None), hw, price)
    if largest >= model.ctx_train:
        return model.ctx_train, f"no -c given: planned at the model's trained context, {model.ctx_train}, which fits"
    if largest >= FIT_CTX_MIN:
        return largest, (f"no -c given: planned at {largest}, the largest context that fits (the model's trained "
                         f"context, {model.ctx_train}, is its ceiling); pass -c for the one you run")
    return FIT_CTX_MIN, (f"no -c given: planned at {FIT_CTX_MIN}, the least llama.cpp's --fit would shrink it to; no "
                         "context fits here (see the verdicts); pass -c for the one you run")
