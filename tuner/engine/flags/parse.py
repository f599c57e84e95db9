"""argv → LaunchConfig: a pasted ``llama-server …`` line, and llama-fit-params' chosen flags, read back."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import tuner.engine.flags.dialect as dialect
from tuner.core.config import CacheType, FlashAttn, LaunchConfig, SpecType
from tuner.core.errors import UsageError
from tuner.engine.flags.env import config_env_fields
from tuner.engine.flags.render import _IGNORED_BARE, _IGNORED_WITH_VALUE, _SPEC_NUMBERS, _SPELL, SERVER, validate
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP, EngineKind

# One part of an -ot list that moves FFN tensors of some layers: ``blk\.(3|4|5)\.ffn_(up|down|gate)_exps=CPU``
# (a hand-written line), or as llama-fit-params prints them (common/fit.cpp, ``get_overflow_pattern``):
# ``blk\.25\.ffn_(gate|gate_up|down).*=CPU`` for the first partial layer, ``blk\.26\.ffn_(up|down|gate_up|gate)_
# (ch|)exps=CPU`` for each further one, and ``blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU`` for every layer.
_OT_PART = re.compile(r'blk\\?\.(?:\(([0-9|]+)\)|([0-9]+)|(\\d\+))\\?\.ffn_[^=]*=([^,\s"]+)')


@dataclass(frozen=True, slots=True)
class ParsedCommand:
    config: LaunchConfig
    # Flags that do not change speed or memory (host, port, sampling, logging): dropped from the config.
    ignored: tuple[str, ...] = ()
    program: str = SERVER  # the first word after the environment, as pasted (a path, or a longer name)
    # Every leading ``VAR=value`` word, as pasted: only :func:`config_env_fields`' variables reach the config.
    env: tuple[tuple[str, str], ...] = ()


_ALIASES = {s: name for name, spellings in _SPELL.items() for s in spellings}
_ALIASES.update({"--n-cpu-moe": "n_cpu_moe", "-ncmoe": "n_cpu_moe", "--no-mmap": "no_mmap", "--mmap": "mmap",
                 "--repack": "repack", "--fit": "fit",
                 "--no-host": "no_host", "--no-op-offload": "no_op_offload", "--op-offload": "op_offload"})
_INT_FIELDS = {"ctx", "parallel", "n_gpu_layers", "n_cpu_moe", "threads", "threads_batch", "batch", "ubatch",
               "cache_reuse", "ctx_checkpoints", "checkpoint_min_step", "cache_ram_mib", "fit_target_mib"}
_BARE = {"kv_unified", "no_kv_unified", "swa_full", "no_repack", "repack", "no_mmap", "mmap", "no_host",
         "no_op_offload", "op_offload"}


# ik_llama.cpp's own levers as its llama-server spells them (tuner.engine.flags.dialect): flag → (field, value taken
# from the next word, or the value a bare flag sets).
_IK_BARE = {s: (field, value) for field, setting, value in (
    ("run_time_repack", "run_time_repack", True), ("fused_moe", "no_fused_moe", False),
    ("merge_up_gate", "merge_up_gate", True), ("graph_reuse", "no_graph_reuse", False),
    ("only_active_experts", "no_only_active_experts", False)) for s in dialect.IK_SERVER_SPELL[setting]}
_IK_BARE.update({"-gr": ("graph_reuse", True), "--graph-reuse": ("graph_reuse", True)})
_IK_VALUED = {s: field for field, setting in (("attn_max_batch", "attn_max_batch"), ("smart_experts", "smart_experts"))
              for s in dialect.IK_SERVER_SPELL[setting]}


def parse_command(text: str, kind: EngineKind | None = None) -> ParsedCommand:
    """Read a pasted ``llama-server …`` command (shell quoting, ``\\`` line breaks, ``VAR=x`` prefixes). ``kind``:
    the engine the line is for; None: ik_llama.cpp where the line carries one of its own levers, else llama.cpp."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "))
    except ValueError as exc:
        raise UsageError(f"cannot read the pasted command ({exc}): check its quotes") from None
    assignments: dict[str, str] = {}
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
        key, _, val = tokens.pop(0).partition("=")  # environment assignments before the program
        assignments[key] = val
    if not tokens or not os.path.basename(tokens[0]).startswith("llama-server"):
        raise UsageError("the pasted command must start with llama-server: paste the whole launch line")
    values: dict[str, object] = {}
    ignored: list[str] = []
    if kind is None:
        kind = IK_LLAMA if any(t.partition("=")[0] in _IK_BARE or t.partition("=")[0] in _IK_VALUED
                               for t in tokens[1:]) else LLAMA_CPP
    i = 1
    while i < len(tokens):
        tok = tokens[i]
        flag, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        i += 1

        def value(flag: str = flag, eq: str = eq, inline: str = inline) -> str:
            nonlocal i
            if eq:
                return inline
            if i >= len(tokens):
                raise UsageError(f"{flag} needs a value in the pasted command")
            i += 1
            return tokens[i - 1]

        if flag in _IGNORED_BARE:
            ignored.append(flag)
            continue
        if flag in _IGNORED_WITH_VALUE:
            ignored.append(f"{flag} {value()}")
            continue
        if flag in _IK_BARE and kind.has_lever(_IK_BARE[flag][0]):
            field, setting = _IK_BARE[flag]
            values[field] = setting
            continue
        if flag in _IK_VALUED and kind.has_lever(_IK_VALUED[flag]):
            values[_IK_VALUED[flag]] = value()
            continue
        name = _ALIASES.get(flag)
        if flag in ("--fit", "-fit"):
            if not kind.fits_by_default:  # ik's is a switch, off unless given: moe-tune measures lines without it
                raise UsageError("--fit in an ik_llama.cpp line is not measured by moe-tune: remove it and give "
                                 "the placement (-ngl, --n-cpu-moe)")
            values["fit"] = value()
            continue
        if name is None or name == "fit":
            raise UsageError(
                f"{flag} in the pasted command is not something moe-tune measures: remove it and paste again"
            )
        if name in _BARE:
            values[name] = True
        elif name == "flash_attn":
            # Older builds took a bare -fa; it meant "on".
            if not eq and (i >= len(tokens) or tokens[i].startswith("-")):
                values[name] = "on"
            else:
                values[name] = value()
        else:
            values[name] = value()
    values.update(config_env_fields(assignments))
    return ParsedCommand(_config_from(values, kind), tuple(ignored), tokens[0], tuple(assignments.items()))


def _levers(values: dict[str, object], kind: EngineKind) -> dict[str, object]:
    """The kind's own levers of a pasted line as LaunchConfig fields (ik_llama.cpp's: two of them take values)."""
    out: dict[str, object] = {k: values[k] for k in kind.levers if k in values}
    try:
        if "attn_max_batch" in values:
            out["attn_max_batch"] = int(str(values["attn_max_batch"]))
        if "smart_experts" in values:
            n_min, _, thresh = str(values["smart_experts"]).partition(",")
            out["smart_experts"] = (int(n_min), float(thresh))
    except ValueError:
        raise UsageError("-amb takes a whole number and -ser MIN,THRESH (e.g. -ser 6,0.5): fix it in the pasted "
                         "command") from None
    return out


def _config_from(values: dict[str, object], kind: EngineKind = LLAMA_CPP) -> LaunchConfig:
    if "model" not in values:
        raise UsageError("the pasted command has no -m MODEL: add the model path")
    fit = str(values.pop("fit", "on")).lower()
    if fit not in ("on", "off", "1", "0", "true", "false", "enabled", "disabled"):
        raise UsageError(f"--fit takes on or off, got {fit!r}: fix it in the pasted command")
    if fit in ("off", "0", "false", "disabled") and "n_gpu_layers" not in values and "n_cpu_moe" not in values:
        # --fit off with no placement: llama.cpp's default -ngl -1 then means every layer on the GPU
        # (llama_model::n_gpu_layers), which -ngl all states and renders without --fit.
        values["n_gpu_layers"] = "all"
    kwargs: dict[str, object] = {"model": Path(str(values["model"]))}
    for name in _INT_FIELDS & values.keys():
        raw = str(values[name])
        if name == "n_gpu_layers" and raw in ("auto", "all"):
            if raw == "all":
                kwargs[name] = 999  # more than any model has: every layer
            continue
        try:
            kwargs[name] = int(raw)
        except ValueError:
            raise UsageError(f"{name} must be a whole number, got {raw!r}: fix it in the pasted command") from None
    for name in ("cache_type_k", "cache_type_v"):
        if name in values:
            try:
                kwargs[name] = CacheType(str(values[name]).lower())
            except ValueError:
                allowed = ", ".join(t.value for t in CacheType)
                raise UsageError(f"unknown KV cache type {values[name]!r}: use one of {allowed}") from None
    if "flash_attn" in values:
        fa = {"1": "on", "0": "off", "true": "on", "false": "off"}.get(str(values["flash_attn"]).lower(),
                                                                        str(values["flash_attn"]).lower())
        try:
            kwargs["flash_attn"] = FlashAttn(fa)
        except ValueError:
            raise UsageError(f"-fa takes on, off or auto, got {values['flash_attn']!r}") from None
    if values.get("kv_unified"):
        kwargs["kv_unified"] = True
    if values.get("no_kv_unified"):
        kwargs["kv_unified"] = False
    kwargs["swa_full"] = bool(values.get("swa_full", False))
    if values.get("no_mmap") or str(values.get("load_mode", "")) == "none":
        kwargs["mmap"] = False
    elif "load_mode" in values and str(values["load_mode"]) not in ("auto", "mmap"):
        raise UsageError(f"-lm {values['load_mode']} is not measured by moe-tune: use -lm none or mmap")
    kwargs["repack"] = not values.get("no_repack", False)
    kwargs["no_host"] = bool(values.get("no_host", False))
    kwargs["op_offload"] = not values.get("no_op_offload", False)
    if "op_offload_min_batch" in values:
        kwargs["op_offload_min_batch"] = values["op_offload_min_batch"]
    if "device" in values:
        kwargs["device"] = str(values["device"])
    kwargs.update(_spec_from(values), **_levers(values, kind), engine=kind.name)
    cfg = LaunchConfig(**kwargs)  # type: ignore[arg-type]
    if not kind.maps_model(cfg):  # a lever that loads without a mapping (ik's -rtr) is a line without mmap
        cfg = replace(cfg, mmap=False)
    validate(cfg)
    return cfg


def parse_spec_types(text: str) -> tuple[SpecType, ...]:
    """``--spec-type``'s comma list (``none``: no speculation)."""
    try:
        return tuple(SpecType(n.strip()) for n in text.split(",") if n.strip() not in ("", "none"))
    except ValueError:
        allowed = ", ".join(t.value for t in SpecType)
        raise UsageError(f"unknown --spec-type in {text!r}: use none or {allowed}") from None


def _spec_from(values: dict[str, object]) -> dict[str, object]:
    """Speculation flags of a pasted command as LaunchConfig fields."""
    out: dict[str, object] = {"spec_types": parse_spec_types(str(values.get("spec_types", "")))}
    if "draft_model" in values:
        out["draft_model"] = Path(str(values["draft_model"]))
    try:
        for name in _SPEC_NUMBERS:
            if name in values:
                raw = str(values[name])
                out[name] = int(raw) if name.endswith(("n_max", "n_min")) else float(raw)
        if "spec_synth_rates" in values:
            out["spec_synth_rates"] = tuple(float(r) for r in str(values["spec_synth_rates"]).split(","))
    except ValueError:
        raise UsageError("a --spec-* value in the pasted command is not a number: fix it") from None
    return out


def parse_fit_line(line: str, base: LaunchConfig, n_layers: int) -> LaunchConfig:
    """``base`` placed as llama-fit-params chose (its ``-c … -ngl … -ot …`` line); ``-ngl -1`` means all layers.

    ``-ot`` parts that put any FFN tensor of a layer on the CPU count that layer in ``--n-cpu-moe``. llama.cpp's
    fit moves the experts of the *last* layers (common/fit.cpp, ``set_ngl_tensor_split_tbo``: the first
    ``n_full()`` layers of a device stay whole, the partial ones follow), ``--n-cpu-moe`` those of the first: the
    same count holds the same bytes on uniform layers. The first partial layer keeps part of its FFN on the GPU,
    so counting it whole rounds towards the host (a placement that fits wherever the fit's does). Its range ends
    at the output layer (index ``n_layers``, which has no ``blk.`` tensors): only indices below ``n_layers``
    count. ``blk\\.\\d+`` (every layer's experts) counts ``n_layers``."""
    tokens = shlex.split(line)
    cfg = base
    layers: set[int] = set()
    every = False
    for flag, value in zip(tokens, tokens[1:], strict=False):
        if flag in _SPELL["ctx"]:
            cfg = replace(cfg, ctx=int(value))
        elif flag in _SPELL["n_gpu_layers"]:
            cfg = replace(cfg, n_gpu_layers=None if int(value) < 0 else int(value))
        elif flag in ("-ot", "--override-tensor"):
            for m in _OT_PART.finditer(value):
                group, single, all_layers, buft = m.groups()
                if not buft.upper().startswith("CPU"):
                    continue  # overflow to another GPU (-ts): still on a device
                every = every or bool(all_layers)
                layers.update(int(x) for x in (group or single or "").split("|") if x)
    layers = {il for il in layers if il < n_layers}
    if every:
        cfg = replace(cfg, n_cpu_moe=n_layers)
    elif layers:
        cfg = replace(cfg, n_cpu_moe=len(layers))
    return cfg


def fit_choice_line(stdout: str) -> str | None:
    """The line of llama-fit-params' output that holds its chosen flags (it starts with the context flag)."""
    return next((ln for ln in reversed(stdout.splitlines()) if ln.strip().startswith(_SPELL["ctx"][0] + " ")), None)
