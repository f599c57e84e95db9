"""The compare-quants terminal table at 80 columns, on the widest cells a real comparison produces (long quant
names, a MoE mix, a capped offload range, asymmetric KV types, three-figure speeds): one line per quant, no cell
cut or folded. The same table from measured rows is checked in test_compare_make."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console

from tuner.cli.cmd_compare import table_of
from tuner.quants.compare import Comparison, QuantRow, config_name

GiB = 2**30


def _row(quant: str, size_gib: float, fit: str, config: dict, gen: float, gen_err: float, pp: float, kld: float,
         kld_err: float, verdict: str, pareto: bool = False) -> QuantRow:
    return QuantRow(quant=quant, path=f"/m/{quant}.gguf", size_bytes=round(size_gib * GiB), n_parts=1, fit=fit,
                    config_name=config_name(config), gen_tok_s=gen, gen_tok_s_error=gen_err, prompt_tok_s=pp,
                    kld_mean=kld, kld_mean_error=kld_err, verdict=verdict, pareto=pareto, depth_tokens=4096,
                    launch_line=f"llama-server -m /m/{quant}.gguf -c 4096 --n-cpu-moe 40 -ctk q8_0 -ctv q4_0 -fa on")


ROWS = (
    _row("Q3_K_M/Q8_0", 14.2, "offload 12..40", {"cache_type_k": "q8_0", "cache_type_v": "q4_0", "n_cpu_moe": 40},
         135.1, 14.3, 12345.0, 0.0123, 0.0004, "below speed floor", True),
    _row("UD-Q4_K_XL", 17.6, "offload 8", {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "n_cpu_moe": 12}, 35.1,
         4.3, 1234.0, 0.0081, 0.0003, "undecided"),
    _row("BF16", 113.4, "no", {"cache_type_k": "f16", "cache_type_v": "f16", "n_cpu_moe": 48}, 2.4, 0.1, 80.0,
         0.0, 0.0, "over loss budget"),  # the reference (below)
    _row("Q8_0", 32.5, "RAM (no GPU)", {}, 12.0, 0.4, 800.0, 0.0005, 0.0001, "pick", True),
)


def test_the_widest_rows_fit_80_columns_one_line_each():
    rows = tuple(replace(r, is_reference=r.quant == "BF16") for r in ROWS)
    cmp = Comparison(title="unsloth/Qwen3-30B-A3B-GGUF", reference="/m/BF16.gguf", rows=rows, out_dir=Path("o"))
    console = Console(width=80, record=True, color_system=None)
    console.print(table_of(cmp, "at -c 4096 on NVIDIA GeForce RTX 3090 (24.0 GiB)"))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    rule = next(i for i, line in enumerate(lines) if set(line) == {"─"})
    header, body = lines[rule - 1], lines[rule + 1: rule + 1 + len(ROWS)]
    assert header.split() == ["quant", "size", "fit", "config", "gen", "t/s", "pp", "t/s", "mean", "KLD", "verdict"]
    assert [line.split()[0] for line in body] == ["Q3_K_M/Q8_0*", "UD-Q4_K_XL", "BF16", "Q8_0*"]
    assert "…" not in "\n".join(lines[:rule + 1 + len(ROWS)])
    assert body[0].split() == ["Q3_K_M/Q8_0*", "14.2G", "cm12-40", "q8/q4", "cm40", "135±14", "12,345",
                               "0.0123±0.0004", "too", "slow"]
    assert body[3].split() == ["Q8_0*", "32.5G", "RAM", "f16", "12.0±0.4", "800", "0.0005±0.0001", "pick"]
    assert body[2].split() == ["BF16", "113G", "no", "f16", "cm48", "2.4±0.1", "80.0", "0", "(ref)", "over", "KLD"]
    assert "Pareto front" in "\n".join(lines[rule + 1 + len(ROWS):])  # the caption
