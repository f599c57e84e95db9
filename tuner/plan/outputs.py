"""How many rows of logits the reserve graph computes: the outputs the compute buffer is sized for.

``llama_context``'s reserve takes ``min(n_tokens, n_outputs_max)``; ``n_outputs_max`` defaults to the batch (every
token an output), which is what llama-fit-params projects and what a program other than llama-server gets.
llama-server sets it from ``server_output_limits`` (tools/server/server-context.cpp): per slot one token plus the
most a speculation mode drafts (``common_speculative_get_output_limits``), where that most is
``common_speculative_n_max`` (common/speculative.cpp) over the modes, at common/common.h's defaults: a draft model's
or head's ``--spec-draft-n-max`` (3), an n-gram map's mgram size (48), ngram-mod's ``n_max`` (64), ngram-cache 8.
"""

from __future__ import annotations

from tuner.core.config import LaunchConfig, SpecType

DRAFT_N_MAX = 3  # common_params_speculative_draft::n_max
NGRAM_MAP_SIZE_M = 48  # common_params_speculative_ngram_map::size_m
NGRAM_MOD_N_MAX = 64  # common_params_speculative_ngram_mod::n_max
NGRAM_CACHE_N_MAX = 8  # common_speculative_n_max's constant for ngram-cache
_NGRAM_MAPS = (SpecType.NGRAM_SIMPLE, SpecType.NGRAM_MAP_K, SpecType.NGRAM_MAP_K4V)


def draft_n_max(cfg: LaunchConfig) -> int:
    """``common_speculative_n_max``: the most tokens any of ``cfg``'s speculation modes drafts at once (0: none)."""
    n = 0
    for t in cfg.spec_types:
        if t in _NGRAM_MAPS:
            n = max(n, NGRAM_MAP_SIZE_M)
        elif t is SpecType.NGRAM_MOD:
            n = max(n, NGRAM_MOD_N_MAX)
        elif t is SpecType.NGRAM_CACHE:
            n = max(n, NGRAM_CACHE_N_MAX)
        else:  # the draft modes: a second model, EAGLE-3, the model's MTP head, ...
            n = max(n, cfg.spec_draft_n_max if cfg.spec_draft_n_max is not None else DRAFT_N_MAX)
    return n


def reserved_outputs(cfg: LaunchConfig, n_ubatch: int, n_seq: int, fit_params: bool = False) -> int:
    """Rows of logits reserved for a ubatch of ``n_ubatch`` tokens with ``n_seq`` slots: llama-server's limit, or
    with ``fit_params`` every token (llama-fit-params' projection, llama.cpp's default)."""
    if fit_params:
        return n_ubatch
    return max(1, min(n_ubatch, n_seq * (1 + draft_n_max(cfg))))
