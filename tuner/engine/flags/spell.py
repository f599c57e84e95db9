"""How each tool spells a setting (llama.cpp's names first, ik_llama.cpp's where they differ:
:mod:`~tuner.engine.flags.dialect`) and the argv builder that picks the spelling the detected binary accepts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tuner.engine.flags.dialect as dialect
from tuner.core.errors import UnsupportedFlagError
from tuner.engine.caps import Capabilities
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP, EngineKind

SERVER = "llama-server"
BENCH = "llama-bench"
PERPLEXITY = "llama-perplexity"
FIT_PARAMS = "llama-fit-params"
BATCHED_BENCH = "llama-batched-bench"

# Setting → spellings, preferred first. llama-bench prefers the short forms its own --help lists first.
_SPELL: dict[str, tuple[str, ...]] = {
    "model": ("-m", "--model"),
    "ctx": ("-c", "--ctx-size"),
    "parallel": ("-np", "--parallel"),
    "n_gpu_layers": ("-ngl", "--n-gpu-layers", "--gpu-layers"),
    "n_cpu_moe": ("--n-cpu-moe", "-ncmoe"),
    "cache_type_k": ("-ctk", "--cache-type-k"),
    "cache_type_v": ("-ctv", "--cache-type-v"),
    "threads": ("-t", "--threads"),
    "threads_batch": ("-tb", "--threads-batch"),
    "batch": ("-b", "--batch-size"),
    "ubatch": ("-ub", "--ubatch-size"),
    "flash_attn": ("-fa", "--flash-attn"),
    "kv_unified": ("--kv-unified", "-kvu"),
    "no_kv_unified": ("--no-kv-unified", "-no-kvu"),
    "swa_full": ("--swa-full",),
    # Prompt reuse (common/arg.cpp at the pin: --cache-reuse, -ctxcp, -cms and -cram are llama-server's).
    "cache_reuse": ("--cache-reuse",),
    "ctx_checkpoints": ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"),
    "checkpoint_min_step": ("-cms", "--checkpoint-min-step"),
    "cache_ram_mib": ("-cram", "--cache-ram"),
    "load_mode": ("-lm", "--load-mode"),
    "no_repack": ("--no-repack", "-nr"),
    "no_host": ("--no-host",),
    "no_op_offload": ("--no-op-offload",),
    "device": ("-dev", "--device"),
    "fit": ("--fit", "-fit"),
    "fit_print": ("-fitp", "--fit-print"),
    "fit_target_mib": ("-fitt", "--fit-target"),
    "log_jsonl": ("--log-jsonl",),
    "spec_types": ("--spec-type",),
    "draft_model": ("-md", "--spec-draft-model", "--model-draft"),
    "spec_draft_n_max": ("--spec-draft-n-max",),
    "spec_draft_n_min": ("--spec-draft-n-min",),
    "spec_draft_p_min": ("--spec-draft-p-min", "--draft-p-min"),
    "spec_synth_len": ("--spec-synth-len",),
    "spec_synth_rates": ("--spec-synth-rates",),
}
_SPEC_NUMBERS = ("spec_draft_n_max", "spec_draft_n_min", "spec_draft_p_min", "spec_synth_len")
_BENCH_SPELL = {"n_cpu_moe": ("-ncmoe", "--n-cpu-moe"), "repack": ("--repack",), "depth": ("-d", "--n-depth"),
                "no_op_offload": ("-nopo", "--no-op-offload")}

# Flags a pasted command may carry that do not change speed or memory: dropped, and reported as dropped.
_IGNORED_WITH_VALUE = {
    "--host", "--port", "-a", "--alias", "--api-key", "--api-key-file", "--temp", "--temperature", "--top-k",
    "--top-p", "--min-p", "--repeat-penalty", "--presence-penalty", "--seed", "-s", "--chat-template",
    "--chat-template-file", "--log-file", "-lv", "--verbosity", "--log-verbosity", "--timeout", "-to",
    "--threads-http", "--reasoning-format", "--reasoning-budget", "--slot-save-path", "--path", "--api-prefix",
    "--chat-template-kwargs", "--ssl-key-file", "--ssl-cert-file", "--sleep-idle-seconds", "-n", "--n-predict",
    "--predict", "--tags",
}
_IGNORED_BARE = {
    "--jinja", "--no-jinja", "--metrics", "--slots", "--no-slots", "--props", "--no-webui", "--no-ui", "-v",
    "--verbose", "--log-jsonl", "--no-log-jsonl", "--log-timestamps", "--log-prefix", "--log-colors",
    "--no-warmup", "--warmup", "--cont-batching", "-cb", "--embedding", "--embeddings", "--no-context-shift",
    "--context-shift", "--log-disable", "--perf", "--no-perf",
}



class _Argv:
    """Collects flags for one tool, spelled as that tool's binary accepts them, in its engine's dialect."""

    def __init__(self, binary: Path, tool: str, caps: Capabilities | None, kind: EngineKind = LLAMA_CPP) -> None:
        self.tool = tool
        self.caps = caps
        self.kind = kind
        self.argv: list[str] = [str(binary)]

    def _spellings(self, setting: str) -> tuple[str, ...]:
        if self.kind is IK_LLAMA:
            table = dialect.IK_BENCH_SPELL if self.tool == BENCH else dialect.IK_SERVER_SPELL
            if setting in table:
                return table[setting]
        return (_BENCH_SPELL.get(setting) if self.tool == BENCH else None) or _SPELL[setting]

    def add(self, setting: str, *values: str) -> None:
        spellings = self._spellings(setting)
        flag = spellings[0]
        if self.caps is not None and self.tool in self.caps.flags:
            usable = [s for s in spellings if self.caps.supports(self.tool, s)]
            if not usable:
                shown = f"{flag} {' '.join(values)}".strip()
                raise UnsupportedFlagError(
                    f"{self.tool} of this engine ({self.kind.name}) does not accept {shown}: update it "
                    f"(`moe-tune engine install --engine {self.kind.key}`) or leave that setting at its default"
                )
            flag = usable[0]
        self.argv += [flag, *values]

    def add_words(self, words: Sequence[str]) -> None:
        """Flags already spelled in this kind's dialect (a flag, then its value when it takes one)."""
        i = 0
        while i < len(words):
            flag = words[i]
            value = words[i + 1:i + 2] if i + 1 < len(words) and not words[i + 1].startswith("-") else []
            if self.caps is not None and self.tool in self.caps.flags and not self.caps.supports(self.tool, flag):
                raise UnsupportedFlagError(
                    f"{self.tool} of this engine ({self.kind.name}) does not accept {flag}: update it "
                    f"(`moe-tune engine install --engine {self.kind.key}`) or leave that lever at its default")
            self.argv += [flag, *value]
            i += 1 + len(value)
