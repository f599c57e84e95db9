"""The only place llama.cpp flags are spelled: LaunchConfig ↔ argv for llama-bench, llama-server,
llama-perplexity and llama-fit-params; sources → argv for llama-quantize and llama-imatrix;
text → argv for llama-tokenize; the settings the engine reads from its environment (:mod:`~tuner.engine.flags.env`).

:mod:`~tuner.engine.flags.render` turns a config into argv (the measured argv and the emitted launch line come
from the same function, so they cannot differ); :mod:`~tuner.engine.flags.parse` reads argv back: a pasted
``llama-server …`` line, or the flags llama-fit-params chose. Nothing outside this package spells a flag
(tests/test_architecture.py checks it).
"""

from tuner.engine.flags.bench_argv import bench_argv, bench_group_argv
from tuner.engine.flags.env import CONFIG_ENV, OP_OFFLOAD_MIN_BATCH_DEFAULT, OP_OFFLOAD_MIN_BATCH_ENV, server_env
from tuner.engine.flags.parse import ParsedCommand, fit_choice_line, parse_command, parse_fit_line, parse_spec_types
from tuner.engine.flags.quantize import (
    IMATRIX,
    QUANTIZE,
    help_argv,
    imatrix_argv,
    parse_quant_bpw,
    parse_quant_size_bytes,
    parse_quant_types,
    quantize_argv,
)
from tuner.engine.flags.render import (
    BATCHED_BENCH,
    BENCH,
    FIT_PARAMS,
    PERPLEXITY,
    SERVER,
    address_argv,
    api_key_file_argv,
    batched_bench_argv,
    chunk_rows_argv,
    file_log_argv,
    fit_params_argv,
    launch_line,
    listen_argv,
    perplexity_argv,
    server_accepts,
    server_argv,
    server_logs_jsonl,
    spelled,
    takes_value,
    trace_argv,
    validate,
    with_fit_target,
    with_overrides,
    without_reuse,
)
from tuner.engine.flags.tokenize import TOKENIZE, parse_token_ids, tokenize_argv

__all__ = [
    "BATCHED_BENCH", "BENCH", "FIT_PARAMS", "PERPLEXITY", "SERVER", "ParsedCommand",
    "CONFIG_ENV", "OP_OFFLOAD_MIN_BATCH_DEFAULT", "OP_OFFLOAD_MIN_BATCH_ENV", "server_env",
    "address_argv", "api_key_file_argv", "chunk_rows_argv", "file_log_argv",
    "batched_bench_argv", "bench_argv", "bench_group_argv", "fit_choice_line", "fit_params_argv",
    "launch_line", "listen_argv", "parse_command", "parse_fit_line", "parse_spec_types", "perplexity_argv",
    "server_accepts", "server_argv", "server_logs_jsonl", "spelled", "takes_value", "trace_argv", "validate",
    "with_fit_target", "with_overrides", "without_reuse",
    "IMATRIX", "QUANTIZE", "imatrix_argv", "parse_quant_bpw", "parse_quant_size_bytes", "parse_quant_types",
    "quantize_argv",
    "help_argv",
    "TOKENIZE", "parse_token_ids", "tokenize_argv",
]
