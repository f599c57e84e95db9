"""What a shared record's speeds may claim for a model on a card: generation reads at least the model's per-token
bytes (:func:`tuner.plan.roofline.roofline`: dense weights, the active share of the experts), so no line generates
faster than the card's bandwidth over those bytes. A record above that bound is refused in one line.

The bound comes from the card, the model the user has and the workload only, never from the record: the header of
the file looked up (a local file, or a Hub quant's header read with range requests) gives the roofline exactly;
another quant of the same repo is bound by its listed size times the architecture's active share (a looser bound:
every dense byte is read whole, so a token reads at least that share of the file). Where neither header nor
listing could be read, or the card's bandwidth is not known, nothing bounds a record's figures: its lines are
still offered (the gate checked them), but no figure of it is shown (:func:`unbounded`), and the look-up says why.

A GPU record's bound uses the catalog's bandwidth for its card (a card the catalog does not know is only ever the
same card as this machine's); a CPU record's, :data:`tuner.share.match.HOST_CEILING_BYTES_S`.

Nothing a record says raises its own ceiling. A line with speculative decoding may accept several tokens per read,
and gets :data:`SPEC_TOKENS_PER_STEP`, a constant (the engine's longest default draft plus one), never its own
``--spec-draft-n-max``. Per-request figures (``gen_tok_s``, ``loaded_gen_tok_s``) are bound by one stream's
ceiling; the total over every slot (``end_to_end_gen_tok_s``) by the workload's concurrent requests times it
(the workload's concurrency is itself bounded by the gate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.engine import flags
from tuner.engine.kinds import kind_by_name
from tuner.plan.roofline import roofline
from tuner.share.gate import shown
from tuner.share.match import Matched

# The engine's most generous draft per verify step (common/common.h: ngram-mod n_max 64; draft models 3 unless
# --spec-draft-n-max), plus the verified token.
SPEC_TOKENS_PER_STEP = 65
# No published MoE reads less than this share of its file per token (the sparsest, ~3 % active, read more): the
# share of a repo's listed quant where no header of the repo gave the architecture's own.
SPARSEST_SHARE = 1 / 64
# Spec-sheet bandwidths are rounded and the roofline counts an MTP block a plain token does not read.
MARGIN = 1.1
PER_REQUEST = ("gen_tok_s", "loaded_gen_tok_s")  # one stream's tokens per second
TOTAL = ("end_to_end_gen_tok_s",)  # every slot's together


def bytes_per_token(model: ModelInfo) -> float:
    """The least a generated token reads of ``model`` at depth 0, wherever its weights sit."""
    host_only = Hardware(gpu_name="", vram_total_bytes=0, vram_free_bytes=0, gpu_bandwidth_bytes_s=0.0,
                         pcie_bandwidth_bytes_s=0.0, ram_total_bytes=0, ram_available_bytes=0, swap_total_bytes=0,
                         host_bandwidth_bytes_s=1.0, physical_cores=1, source="none")
    r = roofline(model, LaunchConfig(model=model.paths[0]), host_only)
    return float(r.gpu_bytes_per_token + r.host_bytes_per_token)


def active_share(model: ModelInfo) -> float:
    return model.n_expert_used / model.n_expert if model.n_expert else 1.0


@dataclass(frozen=True, slots=True)
class ModelBound:
    """What this machine knows of the looked-up model's per-token bytes."""

    exact_bytes: float | None = None  # the looked-up file or quant (its header's roofline)
    exact_quant: str | None = None  # that quant's name (None: a local file, matched by fingerprint too)
    share: float | None = None  # the architecture's active share (from any header of the repo)
    quant_sizes: dict[str, int] = field(default_factory=dict)  # the repo's quants by listed size (upper-case)
    unknown: str | None = None  # why neither header nor listing is known (then nothing bounds a record)

    def least_bytes(self, model: dict[str, Any]) -> tuple[float, str] | str | None:
        """(bytes a token of the record's model reads at least, how that is known); why the record is not of the
        model's repo (a refusal); or None where nothing is known of the model. The record's own size claim is never
        read: a record may say anything of itself."""
        quant = (model.get("quant") or "").upper()
        if self.exact_bytes is not None and (self.exact_quant is None or quant == self.exact_quant.upper()):
            return (self.exact_bytes, "the roofline of its header") if self.exact_bytes > 0 else None
        if self.quant_sizes:
            size = self.quant_sizes.get(quant)
            if size is None:
                return f"quant {model.get('quant')} is not in the model's repo"
            share = self.share if self.share is not None else SPARSEST_SHARE
            return (share * size, f"{share:.3g} of its listed {size / 2**30:.1f} GiB") if size > 0 else None
        return None


def unbounded(m: Matched, bound: ModelBound) -> str | None:
    """Why nothing bounds ``m``'s figures (then none is shown), or None where physics bounds them."""
    if m.bandwidth_bytes_s <= 0:
        return f"the memory bandwidth of {shown(m.record.card['name'], 60)} is not known"
    if bound.least_bytes(m.record.model) is None:
        return f"the model could not be read ({bound.unknown})" if bound.unknown else "the model's size is not known"
    return None


def refused(m: Matched, bound: ModelBound) -> str | None:
    """Why ``m``'s figures break physics on its card, or None (within the bound, or nothing bounds them:
    :func:`unbounded`)."""
    least = bound.least_bytes(m.record.model)
    if isinstance(least, str):
        return least
    if least is None or m.bandwidth_bytes_s <= 0:
        return None
    n_bytes, how = least
    streams = m.record.data["workload"]["concurrency"]
    kind = kind_by_name(m.record.data["engine"]["engine"])
    for ln in m.record.data["lines"]:
        try:
            spec = bool(flags.parse_command(ln["line"], kind).config.spec_types)  # the gate's rendering
        except UsageError as exc:
            return f"{shown(ln['label'], 40)}'s line does not read back ({shown(exc, 80)})"
        stream = MARGIN * (SPEC_TOKENS_PER_STEP if spec else 1) * m.bandwidth_bytes_s / n_bytes
        for keys, ceiling, what in ((PER_REQUEST, stream, "tok/s per request"),
                                    (TOTAL, streams * stream, f"tok/s over {streams} concurrent request(s)")):
            for key in keys:
                if ln[key] is not None and ln[key] > ceiling:
                    return (f"{shown(ln['label'], 40)} claims {key} {ln[key]:,.4g}, above the {ceiling:,.4g} {what} "
                            f"{shown(m.record.card['name'], 60)} can move ({m.bandwidth_bytes_s / 1e9:,.0f} GB/s "
                            f"over {n_bytes / 2**20:,.1f} MiB a token: {how})")
    return None
