"""The reading gate: a shared record is bytes a stranger wrote, and this module is all that stands between them and
the user's terminal, clipboard and search. Read it whole.

- **Bytes**: at most :data:`MAX_RECORD_BYTES`; strict UTF-8 JSON; a duplicate key, a number longer than
  :data:`MAX_NUMBER_CHARS` characters, NaN or Infinity is refused before Python converts anything.
- **Fields**: only the schema's, each of its type (strings printable, at most :data:`MAX_TEXT` characters; names,
  repos, hashes and quants of their own narrow form); every figure finite and not negative; a verdict's interval
  holds its ratio. Fields the schema does not name are dropped.
- **Lines**: every launch line is read by the flag layer's parser and must need nothing but what moe-tune renders:
  the program exactly ``llama-server``, no environment but the variables moe-tune sets, no flag moe-tune does not
  measure, the model (and a draft model) by a bare file name, the record's own model. Per engine, the record's
  (:mod:`tuner.engine.kinds`): of its own levers only those its search measures (``EngineKind.measured_levers``;
  ik_llama.cpp's ``-ser`` drops experts and ``-amb`` is never searched: a line setting one is refused as
  ``unmeasured lever``), and nothing only another engine reads (llama.cpp's ``--no-repack`` on an ik_llama.cpp
  line, ik's ``-rtr`` on a llama.cpp one: ``other engine's flag``). What is kept, shown and
  seeded is the flag layer's rendering of the parsed config, never the stranger's text: that rendering must read
  back as the same config (what llama.cpp runs is what was shown), every number in it must be one llama.cpp
  reads (a 32-bit whole number, finite) and not negative (``-cram -1``, no limit, is nobody's measurement), and
  every word of it is letters, digits and ``._,:=+-`` (nothing a shell expands).
- **Names**: a record's name is 16 hex digits; a sharer is 16 hex digits (version 1 records have none). A sharer
  id labels a record and is never counted: agreement counts Hub accounts (:mod:`tuner.share.accounts`).

Anything else is one :class:`RecordError` line naming the record, with a short ``reason`` a flood is counted by.
Any text of a stranger's that reaches a terminal passes :func:`shown`: runs of spaces collapsed, and every character
outside a narrow set (ASCII and a few typographic signs) written as its escape, so no padding, filler or stacked
combining mark can place text where a line to run stands. What a record's figures may claim for a model on a card
(the roofline) needs the model, and is checked where the model is known (:mod:`tuner.share.physics`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import RecordError, UnsupportedFlagError, UsageError
from tuner.engine import flags
from tuner.engine.flags import dialect
from tuner.engine.kinds import DEFAULT_KIND, KINDS, EngineKind, kind_by_name

SCHEMA = "moe-tune/shared-result"
SCHEMA_VERSION = 2  # 2: the sharer; lines held to the flag layer's rendering
MAX_RECORD_BYTES = 64 * 1024
MAX_LINES = 32
MAX_TEXT = 600  # characters of any one string (a launch line, a reason)
MAX_NUMBER_CHARS = 32  # a JSON number's characters: more is no measurement
MAX_RATIO = 100.0  # a verdict or speed-up beyond 100x (or below 1/100) is no measurement of one card
MAX_CONCURRENCY = 256  # requests a workload serves at once: more is no measurement of one consumer card
CPU_CARD = "cpu"  # the card of a result measured without a GPU

RECORD_NAME = re.compile(r"[0-9a-f]{16}")
SHARER = re.compile(r"[0-9a-f]{16}")
MODEL_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}\.gguf")
_FORMATS = {
    "file": MODEL_FILE,
    "repo": re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}"),
    "hubfile": re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._+-]{0,99}/){0,3}[A-Za-z0-9][A-Za-z0-9._+-]{0,199}\.gguf"),
    "quant": re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}"),
    "sha": re.compile(r"[0-9a-f]{64}"),
    "sharer": SHARER,
    "engine": re.compile("|".join(re.escape(k.name) for k in KINDS)),  # which kind ran it (tuner.engine.kinds)
}
_LINE_WORD = re.compile(r"[A-Za-z0-9._,:=+-]+")

# -- schema: field → kind ("str", "int", "num", "bool" or a format above; a trailing "?" allows null).

CARD = {"name": "str", "vram_total_bytes": "int", "vram_budget_bytes": "int?", "driver": "str?", "pcie_link": "str?"}
HOST = {"ram_total_bytes": "int?", "physical_cores": "int?", "cpu_model": "str?"}
ENGINE = {"version": "str?", "commit": "str?", "backend": "str?", "fa_quants": "str?", "engine": "engine?"}
MODEL = {"hub_repo": "repo?", "hub_file": "hubfile?", "file_name": "file", "quant": "quant?", "size_bytes": "int",
         "head_sha256": "sha?", "tail_sha256": "sha?"}
WORKLOAD = {"kind": "str", "prompt_tokens": "int", "gen_tokens": "int", "depth_tokens": "int?",
            "concurrency": "int"}
LINE = {"label": "str", "round": "str", "line": "str", "slots": "int", "gen_tok_s": "num?", "gen_cv_pct": "num?",
        "prompt_tok_s": "num?", "ttft_s": "num?", "loaded_gen_tok_s": "num?", "end_to_end_gen_tok_s": "num?",
        "vram_peak_bytes": "int?", "spill": "str?", "kld_mean": "num?", "failure": "str?"}
VERDICT = {"a": "str", "b": "str", "rounds": "int", "ratio": "num", "low": "num", "high": "num",
           "noise_pct": "num", "outcome": "str"}
PRINTED = {"label": "str", "line": "str", "why": "str"}
TOP = {"schema": "str", "version": "int", "tool": "str?", "sharer": "sharer?", "card": CARD, "host": HOST,
       "engine": ENGINE, "model": MODEL, "workload": WORKLOAD, "lines": [LINE], "verdicts": [VERDICT],
       "printed": PRINTED, "speedup_vs_default": "num?", "speedup_vs_fit": "num?"}


# What a stranger's text may show as itself: printable ASCII and the few signs moe-tune's own reasons use.
# ``isprintable`` is not enough: U+3164 (a blank-looking letter) and combining marks are printable.
_SAFE = re.compile(r"[ -~×–—…±≥≤→·]")
_SPACES = re.compile(" {2,}")  # padding: a run of spaces can push text to the start of a terminal line


def shown(text: object, limit: int = 160) -> str:
    """A stranger's text as it may reach a terminal: every run of spaces one space, every character outside
    :data:`_SAFE` (ESC, a newline, a tab, bidi controls, fillers, combining marks) written as its escape, cut to
    ``limit`` characters."""
    flat = _SPACES.sub(" ", str(text)).strip(" ")
    s = "".join(c if _SAFE.fullmatch(c) else c.encode("unicode_escape").decode("ascii") for c in flat)
    return s if len(s) <= limit else s[:limit - 1] + "…"


def refusal(name: object, why: str, reason: str) -> RecordError:
    """The one line that says a record (or a file, a shard row) was skipped, and why; ``reason`` names its kind."""
    return RecordError(shown(f"shared record {shown(name, 80)} skipped: {why}", 400), reason)


class _Refused(ValueError):
    """A reason, raised inside the JSON reader's hooks."""


class _LineRefused(ValueError):
    """A line refused for a reason counted apart from the flag layer's (``reason``: the refusal's kind)."""

    def __init__(self, why: str, reason: str) -> None:
        super().__init__(why)
        self.reason = reason


UNMEASURED = "unmeasured lever"
OTHER_ENGINE = "other engine's flag"
_DEFAULTS = {f.name: f.default for f in fields(LaunchConfig) if f.default is not MISSING}


def _set(cfg: LaunchConfig, lever: str) -> bool:
    return bool(getattr(cfg, lever) != _DEFAULTS[lever])


def _pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in items:
        if key in seen:
            raise _Refused(f"key {shown(key, 40)!r} appears twice (readers would disagree on its value)")
        seen.add(key)
    return dict(items)


def _json_number(kind: type) -> Any:
    def convert(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise _Refused(f"a number of {len(text):,} characters")
        return kind(text)
    return convert


def _no_constant(text: str) -> Any:
    raise _Refused(f"{text} is not a measurement")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs, parse_int=_json_number(int),
                          parse_float=_json_number(float), parse_constant=_no_constant)
    except _Refused:
        raise
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _Refused("not JSON") from None


def _check(value: Any, kind: Any, where: str) -> Any:
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object")
        return {k: _check(value.get(k), sub, f"{where}.{k}" if where else k) for k, sub in kind.items()}
    if isinstance(kind, list):
        if not isinstance(value, list) or len(value) > MAX_LINES:
            raise ValueError(f"{where} must be a list of at most {MAX_LINES}")
        return [_check(v, kind[0], f"{where}[{i}]") for i, v in enumerate(value)]
    base, optional = kind.rstrip("?"), kind.endswith("?")
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where} is missing")
    text = isinstance(value, str) and len(value) <= MAX_TEXT and value.isprintable()
    ok = {"str": text, "int": isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53,
          "num": isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
          and 0 <= value < 1e12, "bool": isinstance(value, bool)}.get(base)
    if ok is None:  # a narrow format
        ok = text and _FORMATS[base].fullmatch(value) is not None
    if not ok:
        raise ValueError(f"{where} must be {_KIND_WORDS.get(base, f'a {base} name')}")
    return value


_KIND_WORDS = {"str": f"a string of at most {MAX_TEXT} printable characters", "int": "a whole number, 0 or more",
               "num": "a finite number, 0 or more", "bool": "true or false", "sha": "64 hex digits",
               "sharer": "16 hex digits", "file": "a bare .gguf file name",
               "engine": " or ".join(k.name for k in KINDS)}


def _sane(d: dict[str, Any]) -> None:
    """What the figures of any measurement satisfy, whatever the model."""
    cpu = d["card"]["name"] == CPU_CARD
    if cpu != (d["card"]["vram_total_bytes"] == 0):
        raise ValueError("card.vram_total_bytes must be 0 for the cpu card and more for a GPU")
    if d["model"]["size_bytes"] == 0:
        raise ValueError("model.size_bytes is 0: a model file holds at least its header")
    if d["workload"]["concurrency"] < 1 or any(ln["slots"] < 1 for ln in d["lines"]):
        raise ValueError("a workload and a line serve at least one request at a time")
    if d["workload"]["concurrency"] > MAX_CONCURRENCY:
        raise ValueError(f"workload.concurrency {d['workload']['concurrency']:,} is more than the {MAX_CONCURRENCY} "
                         "requests at once a look-up believes of one card")
    for v in d["verdicts"]:
        if not (1 / MAX_RATIO <= v["ratio"] <= MAX_RATIO and v["low"] <= v["ratio"] <= v["high"]):
            raise ValueError(f"verdict {shown(v['a'], 40)} vs {shown(v['b'], 40)}: ratio {v['ratio']:.3g} "
                             f"outside 1/{MAX_RATIO:.0f}..{MAX_RATIO:.0f} or its interval")
    for key in ("speedup_vs_default", "speedup_vs_fit"):
        if d[key] is not None and not 1 / MAX_RATIO <= d[key] <= MAX_RATIO:
            raise ValueError(f"{key} {d[key]:.3g} is outside 1/{MAX_RATIO:.0f}..{MAX_RATIO:.0f}")


def read_line(text: str, model_file: str, kind: EngineKind = DEFAULT_KIND) -> tuple[str, LaunchConfig]:
    """A stranger's launch line as the flag layer renders it again, in the dialect of the engine the record says ran
    it (``kind``: an ik_llama.cpp line reads as ik's, whatever flags it carries); ValueError where it needs anything
    else."""
    try:
        parsed = flags.parse_command(text, kind)
    except UsageError as exc:
        raise _foreign_lever(text, kind) or ValueError(f"a line the flag layer refuses ({exc})") from None
    if parsed.program != flags.SERVER:
        raise ValueError(f"a line runs {shown(parsed.program, 60)!r}, not {flags.SERVER}")
    foreign = [k for k, _ in parsed.env if k not in flags.CONFIG_ENV]
    if foreign:
        raise ValueError(f"a line sets {shown(', '.join(foreign), 80)}, which moe-tune never sets")
    if parsed.ignored:
        raise ValueError(f"a line carries {shown(' '.join(parsed.ignored), 80)}, which moe-tune does not measure")
    cfg = parsed.config
    for model in (cfg.model, cfg.draft_model):
        if model is not None and MODEL_FILE.fullmatch(str(model)) is None:
            raise ValueError(f"a line names model {shown(model, 80)!r}: a shared line names a model by its bare "
                             ".gguf file name")
    if str(cfg.model) != model_file:
        raise ValueError(f"a line runs {shown(cfg.model, 80)}, not the record's model {model_file}")
    negative = next((f.name for f in fields(cfg) if _number(getattr(cfg, f.name)) and not (
        math.isfinite(getattr(cfg, f.name)) and getattr(cfg, f.name) >= 0)), None)
    if negative is not None:
        raise ValueError(f"a line sets {negative} to {getattr(cfg, negative)}: a shared line's numbers are 0 or more")
    _measured_levers_only(cfg, kind)
    try:
        rendered = flags.launch_line(cfg)
        again = flags.parse_command(rendered, kind).config
    except UsageError as exc:
        raise ValueError(f"a line the flag layer cannot render and read back ({exc})") from None
    if again != cfg:  # what llama.cpp would run is not what was measured
        raise ValueError("a line whose rendering reads back as another config")
    odd = next((w for w in rendered.split(" ") if _LINE_WORD.fullmatch(w) is None), None)
    if odd is not None:
        raise ValueError(f"a line renders the word {shown(odd, 60)!r}, which a shell would read")
    return rendered, cfg


def _measured_levers_only(cfg: LaunchConfig, kind: EngineKind) -> None:
    """Refuse a line that sets one of ``kind``'s levers its search never measures, or a setting ``kind`` does not
    read (another engine's): its figures say nothing of that lever, and its engine may not start with it."""
    unmeasured = [name for name in kind.levers if not kind.measures(name) and _set(cfg, name)]
    if unmeasured:
        words = " and ".join(shown(dialect.lever_words(cfg, name), 40) for name in unmeasured)
        raise _LineRefused(f"a line sets {words}, which moe-tune never measures on {kind.name} (not searched, not "
                           "priced): its figures say nothing of it", UNMEASURED)
    try:
        dialect.check_levers(kind, cfg)
    except UnsupportedFlagError as exc:  # its first clause names the setting and whose it is; the rest, the fix
        raise _LineRefused(f"a line for {kind.name}: {str(exc).split('; ')[0]}", OTHER_ENGINE) from None


def _foreign_lever(text: str, kind: EngineKind) -> _LineRefused | None:
    """Where ``kind``'s parser refused a line: the refusal when the line sets a lever only another kind reads."""
    for other in KINDS:
        if other is kind:
            continue
        try:
            cfg = flags.parse_command(text, other).config
        except UsageError:
            continue
        levers = [name for name in other.levers if _set(cfg, name)]
        if levers:
            words = " and ".join(shown(dialect.lever_words(cfg, name), 40) for name in levers)
            return _LineRefused(f"a line for {kind.name} sets {words}, which only {other.name} reads", OTHER_ENGINE)
    return None


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """A record that passed the gate: ``data`` holds only the schema's fields, every line the flag layer's
    rendering; ``printed`` is the printed line's config."""

    record_id: str  # 16 hex digits: the file's name in the repo (or a shard row's id)
    data: dict[str, Any]
    printed: LaunchConfig

    @property
    def sharer(self) -> str:
        """Who shared it: an installation's random id; every version 1 record (no id) counts as one sharer."""
        return self.data["sharer"] or "unnamed"

    @property
    def card(self) -> dict[str, Any]:
        return dict(self.data["card"])

    @property
    def engine_commit(self) -> str:
        return self.data["engine"]["commit"] or "unknown"

    @property
    def engine_label(self) -> str:
        """The engine as a look-up shows it: llama.cpp's by its commit (as before), another engine by name too."""
        kind = kind_by_name(self.data["engine"].get("engine"))
        return self.engine_commit if kind is DEFAULT_KIND else f"{kind.name} {self.engine_commit}"

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.data["model"])

    def line(self, label: str) -> dict[str, Any] | None:
        return next((ln for ln in self.data["lines"] if ln["label"] == label), None)

    def describe(self) -> str:
        return f"{self.record_id} ({self.card['name']}, engine {self.engine_label}, {self.data['workload']['kind']})"


def read_record(raw: bytes, record_id: str) -> SharedRecord:
    """``raw`` (a record file's bytes, or a shard row's) through the gate; one :class:`RecordError` line otherwise."""
    if RECORD_NAME.fullmatch(record_id) is None:
        raise refusal(record_id, "a record's name is 16 hex digits", "bad name")
    if len(raw) > MAX_RECORD_BYTES:
        raise refusal(record_id, f"{len(raw):,} bytes, more than the {MAX_RECORD_BYTES:,} a record may hold",
                      "too large")
    try:
        data = _json(raw)
    except _Refused as exc:
        raise refusal(record_id, str(exc), "not JSON") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise refusal(record_id, f"not a {SCHEMA} record", "not a record")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise refusal(record_id, "no schema version", "not a record")
    if version > SCHEMA_VERSION:
        raise refusal(record_id, f"schema version {version} is newer than this moe-tune reads ({SCHEMA_VERSION}): "
                                 "upgrade moe-tune (pip install -U moe-tune)", "newer schema")
    stage = "bad field"
    try:
        clean = _check(data, TOP, "")
        stage = "absurd figures"
        _sane(clean)
        stage = "line refused"
        model_file = clean["model"]["file_name"]
        kind = kind_by_name(clean["engine"]["engine"])  # no such field: a record from before ik, llama.cpp's
        clean["printed"]["line"], config = read_line(clean["printed"]["line"], model_file, kind)
        for ln in clean["lines"]:
            ln["line"] = read_line(ln["line"], model_file, kind)[0]
    except ValueError as exc:
        raise refusal(record_id, str(exc), getattr(exc, "reason", stage)) from None
    return SharedRecord(record_id, clean, config)
