"""Speculative decoding as a stage after auto-tune's finish: the printed line against itself with each
speculation mode that applies to this model, measured on llama-server with the workload's own prompts.

Arms: ``none``; the n-gram modes (no second model); the model's MTP head where the file carries one; a draft
model the user names; the draft kinds each at the engine's draft length and p-min and at a shorter and a
longer, pickier setting. Two phases, as the finish (:mod:`tuner.search.decide`): the *selection* runs every arm
in alternating order (:func:`tuner.measure.speculation.measure_arms`) and judges each against ``none`` on the same
prompts by end-to-end request time; the arm with the largest gain beyond the measured noise is selected. The
*confirmation* measures ``none`` and the selected arm again in fresh rounds (3, a 4th while undecided); the arm
enters the launch line only when its verdict against ``none`` on those rounds is "better". Every arm is reported
with the acceptance llama-server measured.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig, SpecType
from tuner.core.errors import UsageError
from tuner.core.machine_spec import Hardware
from tuner.engine import flags
from tuner.engine.build import Capabilities, EngineLocation
from tuner.measure.speculation import (
    Arm,
    ArmResult,
    Gain,
    draft_mismatch,
    load_prompts,
    measure_arms,
    paired_gain,
    without_speculation,
)
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import ModelInfo, has_mtp_head, inspect_model
from tuner.plan import memory
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.verdict import MIN_ROUNDS, UNDECIDED, compare_quiet

NGRAM_TYPES = (SpecType.NGRAM_SIMPLE, SpecType.NGRAM_MAP_K, SpecType.NGRAM_MOD)
# (--spec-draft-n-max, --spec-draft-p-min) per draft kind; None: the engine's default (3 tokens, p-min 0).
DRAFT_VARIANTS: tuple[tuple[int | None, float | None], ...] = ((None, None), (2, None), (6, 0.75))


@dataclass(frozen=True, slots=True)
class SpeculationRequest:
    draft_model: Path | None = None  # --draft: a smaller model with the target's vocabulary
    prompts_file: Path | None = None  # --prompts: real requests; default: windows of the bundled corpus
    ngram_types: tuple[SpecType, ...] = NGRAM_TYPES
    draft_variants: tuple[tuple[int | None, float | None], ...] = DRAFT_VARIANTS
    rounds: int = 2  # selection rounds
    requests: int = 4  # prompts per arm and round
    confirm_rounds: int = MIN_ROUNDS  # fresh rounds of ``none`` and the selected arm (one more while undecided)
    # Benchmarking only: every speculative arm accepts drafts at random with this mean length (tokens per
    # verification step, the target's own included). Measures the mechanics, not the model's acceptance.
    synth_len: float | None = None


def _label(kind: SpecType, draft: Path | None, n_max: int | None, p_min: float | None) -> str:
    parts = [kind.value] + ([draft.name] if draft else [])
    parts += [f"n-max {n_max}"] if n_max is not None else []
    parts += [f"p-min {p_min:g}"] if p_min is not None else []
    return " ".join(parts)


def arms_for(base: LaunchConfig, info: ModelInfo, req: SpeculationRequest) -> list[Arm]:
    """``none`` first, then every speculation mode that applies to this model."""
    plain = without_speculation(base)
    synth: dict[str, Any] = {"spec_synth_len": req.synth_len}
    arms = [Arm("none", plain)]
    arms += [Arm(t.value, replace(plain, spec_types=(t,), **synth)) for t in req.ngram_types]
    kinds: list[tuple[SpecType, Path | None]] = []
    if has_mtp_head(info):
        kinds.append((SpecType.DRAFT_MTP, None))
    if req.draft_model is not None:
        kinds.append((SpecType.DRAFT_SIMPLE, req.draft_model))
    for kind, draft in kinds:
        for n_max, p_min in req.draft_variants:
            arms.append(Arm(_label(kind, draft, n_max, p_min), replace(
                plain, spec_types=(kind,), draft_model=draft, spec_draft_n_max=n_max, spec_draft_p_min=p_min,
                **synth)))
    return arms


@dataclass(frozen=True, slots=True)
class ArmVerdict:
    result: ArmResult
    gain: Gain | None
    kept: bool
    note: str = ""

    def line(self) -> str:
        """One line for the user, e.g. ``ngram-mod: +8.1 % (noise ±3.0 %), 41 % of drafts accepted: beyond the
        noise`` (a selection line: only the confirmation decides)."""
        r = self.result
        if not r.ok:
            return f"{r.arm.label}: {self.note or 'failed'}"
        acc = "nothing drafted" if r.acceptance_rate is None else f"{100 * r.acceptance_rate:.0f} % of drafts accepted"
        gain = "" if self.gain is None else f"{self.gain.gain_pct:+.1f} % (noise ±{self.gain.noise_pct:.1f} %), "
        return f"{r.arm.label}: {gain}{acc}: {'beyond the noise' if self.kept else 'within the noise'}"

    def to_dict(self) -> dict[str, Any]:
        g = self.gain
        return self.result.to_dict() | {"kept": self.kept, "note": self.note,
                                        "gain_pct": g.gain_pct if g else None,
                                        "noise_pct": g.noise_pct if g else None, "pairs": g.pairs if g else 0}


def judge(results: Sequence[ArmResult], notes: dict[str, str] | None = None) -> list[ArmVerdict]:
    """Each arm against ``results[0]`` (``none``): ``kept`` (a candidate for the confirmation) when its end-to-end
    gain exceeds the measured noise."""
    notes = notes or {}
    base = results[0]
    out = [ArmVerdict(base, None, False, "the reference")]
    for r in results[1:]:
        gain = paired_gain(base, r) if base.ok and r.ok else None
        kept = gain is not None and gain.gain_pct > 0 and gain.beyond_noise
        note = notes.get(r.arm.label) or str((r.failure or {}).get("message", ""))
        out.append(ArmVerdict(r, gain, kept, note))
    return out


def best(verdicts: Sequence[ArmVerdict]) -> ArmVerdict | None:
    kept = [v for v in verdicts if v.kept and v.gain is not None]
    return max(kept, key=lambda v: v.gain.gain_pct if v.gain else 0.0) if kept else None


def round_scores(r: ArmResult, load: Workload) -> list[float | None]:
    """Requests per second for one user in each round, from that round's median prompt and generation speed."""
    out: list[float | None] = []
    for rnd in sorted({q.round for q in r.requests}):
        mine = [q for q in r.requests if q.round == rnd]
        pp, tg = (statistics.median(getattr(q, f) for q in mine) for f in ("prompt_tok_s", "gen_tok_s"))
        out.append(1.0 / (load.prompt_tokens / pp + load.gen_tokens / tg) if pp > 0 and tg > 0 else None)
    return out


def as_measurement(r: ArmResult, load: Workload) -> ServerMeasurement:
    """An arm's confirmation rounds as a measurement, labelled with the acceptance it was measured with."""
    from tuner.search.study import config_to_dict

    acc = "" if r.acceptance_rate is None else f", {100 * r.acceptance_rate:.0f} % accepted"
    label = "speculation none" if r.arm.label == "none" else f"speculation {r.arm.label}{acc}"
    return ServerMeasurement(
        label=label, config=config_to_dict(r.arm.config),
        launch_line=flags.launch_line(r.arm.config), argv=list(r.argv), gen_tok_s=r.gen_tok_s,
        gen_samples_tok_s=[q.gen_tok_s for q in r.requests], gen_cv_pct=r.gen_cv_pct, prompt_tok_s=r.prompt_tok_s,
        ttft_s=r.ttft_s, aggregate_gen_tok_s=r.gen_tok_s, scores=round_scores(r, load),
        interference=[r.noise_of(rnd) for rnd in sorted({q.round for q in r.requests})])


def _merged(a: ArmResult, b: ArmResult) -> ArmResult:
    return replace(a, requests=a.requests + b.requests, argv=b.argv or a.argv, failure=b.failure or a.failure,
                   round_noise=a.round_noise + b.round_noise)


def confirm(loc: EngineLocation, base: ArmResult, chosen: ArmResult, load: Workload, req: SpeculationRequest, *,
            log_dir: Path, caps: Capabilities | None = None, texts: Sequence[str] | None = None,
            on_step: Callable[[str], None] | None = None) -> tuple[ArmResult, ArmResult]:
    """``none`` and the selected arm in fresh rounds (numbered after the selection's): ``confirm_rounds`` of them,
    and one more while the verdict on their per-round scores is undecided."""
    arms = [base.arm, chosen.arm]
    first = req.rounds
    got = measure_arms(loc, arms, load, rounds=req.confirm_rounds, requests=req.requests, texts=texts,
                       log_dir=log_dir, caps=caps, on_step=on_step, first_round=first)
    none, spec = (as_measurement(r, load) for r in got)
    v = compare_quiet("a", "b", spec.scores, none.scores, spec.quiet_scores(), none.quiet_scores())
    if v.outcome == UNDECIDED and all(r.ok for r in got):
        more = measure_arms(loc, arms, load, rounds=1, requests=req.requests, texts=texts, log_dir=log_dir,
                            caps=caps, on_step=on_step, first_round=first + req.confirm_rounds)
        got = [_merged(x, y) for x, y in zip(got, more, strict=True)]
    return got[0], got[1]


def run_stage(loc: EngineLocation, base: LaunchConfig, info: ModelInfo, hw: Hardware, req: SpeculationRequest,
              load: Workload, *, log_dir: Path, caps: Capabilities | None = None,
              on_step: Callable[[str], None] | None = None) -> list[ArmVerdict]:
    """Measure and judge every arm for ``base``; arms the memory model says cannot fit are not launched."""
    draft_info = inspect_model(req.draft_model) if req.draft_model is not None else None
    if draft_info is not None:
        why = draft_mismatch(info, draft_info)
        if why:
            raise UsageError(f"--draft {req.draft_model} cannot draft for {info.name}: {why}; "
                             "name a smaller model of the same family")
    texts = load_prompts(req.prompts_file) if req.prompts_file is not None else None
    arms, notes = [], {}
    for arm in arms_for(base, info, req):
        est = memory.estimate(info, arm.config, hw, draft_info)
        if est.verdict is not memory.Verdict.FITS:
            notes[arm.label] = f"not launched: the memory model says it {est.verdict.value}"
            continue
        arms.append(arm)
    results = measure_arms(loc, arms, load, rounds=req.rounds, requests=req.requests, texts=texts,
                           log_dir=log_dir, caps=caps, on_step=on_step)
    skipped = [ArmResult(a, failure={"message": notes[a.label]}) for a in arms_for(base, info, req)
               if a.label in notes]
    verdicts = judge([*results, *skipped], notes)
    if on_step:
        for v in verdicts[1:]:
            on_step(v.line())
    return verdicts


def after_finish(loc: EngineLocation, st: Any, done: Finish, info: ModelInfo, hw: Hardware,
                 req: SpeculationRequest, load: Workload, *, result_dir: Path, caps: Capabilities | None = None,
                 on_step: Callable[[str], None] | None = None) -> Finish:
    """auto-tune's speculation stage: select on the finish's printed line, confirm the selected arm in fresh rounds,
    record every arm (study attr ``speculation`` and ``result_dir/speculation.json``), and hand the finish the
    confirmation (:attr:`tuner.search.finish.Finish.speculation`): its rule decides whether the arm is printed."""
    from tuner.search.study import config_from_dict

    winner = done.winner
    if winner is None:
        return done
    if getattr(load, "concurrency", 1) > 1:
        # The stage measures one request at a time; with every slot busy it would judge another workload.
        if on_step:
            on_step("speculation: judged for one user at a time; this workload keeps several slots busy: skipped")
        return done
    log_dir = result_dir / "logs" / "speculation"
    verdicts = run_stage(loc, config_from_dict(winner.config), info, hw, req, load, log_dir=log_dir, caps=caps,
                         on_step=on_step)
    chosen = best(verdicts)
    confirmed = None
    if chosen is not None:
        texts = load_prompts(req.prompts_file) if req.prompts_file is not None else None
        confirmed = confirm(loc, verdicts[0].result, chosen.result, load, req, log_dir=log_dir, caps=caps,
                            texts=texts, on_step=on_step)
    return join(st, done, verdicts, req, load, result_dir=result_dir, confirmed=confirmed)


def join(st: Any, done: Finish, verdicts: Sequence[ArmVerdict], req: SpeculationRequest, load: Workload, *,
         result_dir: Path, confirmed: tuple[ArmResult, ArmResult] | None = None) -> Finish:
    """Record the stage's verdicts and the confirmation of the selected arm (the largest gain beyond noise), and
    give the confirmation to the finish."""
    winner = done.winner
    chosen = best(verdicts)
    pair = () if confirmed is None else tuple(as_measurement(r, load) for r in confirmed)
    fin = replace(done, speculation=pair)
    printed = fin.winner
    kept = chosen.result.arm.label if chosen and printed is not None and pair and printed is pair[1] else None
    record = {"base": winner.label if winner else None,
              "workload": {"prompt_tokens": load.prompt_tokens, "gen_tokens": load.gen_tokens},
              "prompts": str(req.prompts_file) if req.prompts_file else "bundled corpus",
              "selected": chosen.result.arm.label if chosen else None, "kept": kept,
              "confirmation": fin.verdicts[-1].to_dict() if pair else None,
              "arms": [v.to_dict() for v in verdicts]}
    st.set_user_attr("speculation", record)
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / "speculation.json").write_text(json.dumps(record, indent=2))
    return fin
