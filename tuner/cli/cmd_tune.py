"""`moe-tune auto-tune` (the main job) and `moe-tune launch-line` (the measured winner as a command)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tuner.cli.app import (
    AllowBusy,
    BusyWait,
    DeviceOpt,
    JsonFlag,
    LlamaDir,
    app,
    device_choice,
    err,
    friendly,
    measuring,
    model_path,
    out,
    say_fitted,
)
from tuner.cli.heartbeat import beating
from tuner.cli.tune_out import session_summary, summary
from tuner.core.errors import UsageError
from tuner.measure import workload
from tuner.quality import kv_price
from tuner.search import budget

if TYPE_CHECKING:
    from tuner.search import autotune


if TYPE_CHECKING:
    from tuner.engine import build
    from tuner.machine import hardware
    from tuner.search import study
    from tuner.search.session_stage import SessionRequest
    from tuner.search.speculation import SpeculationRequest
    from tuner.versus.engine_run import SearchHooks



@app.command("auto-tune", short_help="Search the fastest llama-server settings, measured.")
@friendly
def auto_tune_cmd(
    model: Annotated[str | None, typer.Argument(help="GGUF path or REPO:QUANT; default: the demo model.")] = None,
    min_ctx: Annotated[int | None, typer.Option("--min-ctx", help="Context you need, all slots together.")] = None,
    goal: Annotated[str, typer.Option("--goal", help="speed (default) or context (largest context that fits).")]
    = "speed",
    workload_kind: Annotated[workload.WorkloadKind, typer.Option("--workload", help="chat, agent or batch.")]
    = workload.WorkloadKind.CHAT,
    n_prompt: Annotated[int | None, typer.Option("-p", "--n-prompt", help="Prompt tokens per request.")] = None,
    n_gen: Annotated[int | None, typer.Option("-n", "--n-gen", help="Generated tokens per request.")] = None,
    parallel: Annotated[int | None, typer.Option(
        "-np", "--parallel", help="Server slots (concurrency); --workload agent: N agents at once.")] = None,
    depth: Annotated[int | None, typer.Option(
        "--depth", help="Context filled when generating (default: the prompt); e.g. 32768 for a long history.")]
    = None,
    max_kld: Annotated[str | None, typer.Option(
        "--max-kld", help=f"Quality floor: mean KLD (nats/token) the KV cache may add vs f16; absolute, the "
        f"same for every model (default {kv_price.DEFAULT_MAX_KLD}: q8_0 passes, q4_0/q4_0 must earn it; off: "
        "none).")] = None,
    min_tok_s: Annotated[float | None, typer.Option(
        "--min-tok-s", help="Per-request generation floor with every slot busy (concurrent workloads).")] = None,
    vram_margin: Annotated[float | None, typer.Option("--vram-margin", help="MiB of VRAM to leave free.")] = None,
    vram_budget: Annotated[float | None, typer.Option(
        "--vram-budget", help="MiB of VRAM this model may use (default: what is free at start).")] = None,
    ram: Annotated[float | None, typer.Option(
        "--ram", help="GiB of host RAM this model may use (default: what is available at start).")] = None,
    pareto: Annotated[bool, typer.Option("--pareto", help="Optimize gen and prompt tok/s (Pareto front).")]
    = False,
    trials: Annotated[int | None, typer.Option(
        "--trials", help=f"Trials in this run (default {budget.DEFAULT_TRIALS}; with --frontier 3 per context, "
        "at most 7 minutes unless --time says otherwise).")] = None,
    time_limit: Annotated[str | None, typer.Option("--time", help="Time budget, e.g. 20m.")] = None,
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna RDB URL; default sqlite in results/.")]
    = None,
    results_dir: Annotated[Path, typer.Option("--results-dir", help="Where results/<study>/ is written.")]
    = Path("results"),
    seed: Annotated[int, typer.Option("--seed", help="Sampler seed.")] = 0,
    frontier: Annotated[bool, typer.Option(
        "--frontier", help="Measure the trade-off frontier instead of one winner: context (from --min-ctx up to "
        "--max-ctx, log-spaced), slots for batch, KV quality and speed at each context's depth.")] = False,
    max_ctx: Annotated[int | None, typer.Option(
        "--max-ctx", help="Largest context on the --frontier ladder (default: the model's training context).")]
    = None,
    speculate: Annotated[bool, typer.Option(
        "--speculation", help="Then try speculative decoding on the winner (MTP head, n-gram modes, --draft); "
        "kept only when it pays.")] = False,
    draft: Annotated[str | None, typer.Option(
        "--draft", help="Draft model for speculation, same vocabulary (implies --speculation).")] = None,
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", help="Real requests to judge speculation on: JSONL {\"prompt\": ...} or text split by --- lines "
        "(implies --speculation).")] = None,
    device: DeviceOpt = None,
    session_file: Annotated[Path | None, typer.Option(
        "--session", help="Agent workload: judge whole sessions on this OpenAI-style messages JSON (default: the "
        "bundled session at --depth).")] = None,
    seed_from: Annotated[str | None, typer.Option(
        "--seed-from", help="Hugging Face dataset repo of shared results (moe-tune share): their lines for this "
        "model and card join the seeds, measured here like any seed.")] = None,
    session_rounds: Annotated[int, typer.Option(
        "--session-rounds", help="Agent workload: confirmation sessions per arm (interleaved rounds, one more while "
        "undecided; 2 selection rounds come first when several reuse settings compete); 0: no session stage.")] = 3,
    engines: Annotated[str | None, typer.Option(
        "--engines", help="Engines to tune, each with its own levers, then judge head to head on the workload: "
        "llama.cpp, ik (ik_llama.cpp) or llama.cpp,ik. Default: MOE_TUNE_ENGINES, else every engine installed "
        "(llama.cpp alone until `moe-tune engine install --engine ik`).")] = None,
    allow_busy: AllowBusy = False,
    busy_wait: BusyWait = "10m",
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Search the fastest llama-server settings for MODEL on this machine, measured for real, and print the
    launch line. With ik_llama.cpp installed too, each engine is tuned with its own levers and the lines meet
    llama.cpp's default in fresh rounds: the printed line names its engine. Ctrl-C stops cleanly; running it
    again resumes the same study.

    \b
    Examples:
      moe-tune auto-tune unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M --min-ctx 32768 \\
        --workload agent --time 20m
    The trade-off instead of one winner:
      moe-tune auto-tune MODEL --frontier --min-ctx 8192 --max-ctx 131072 \\
        --workload batch
    Agent sessions (prompt reuse tuned, scored by session time):
      moe-tune auto-tune MODEL --workload agent --depth 16384
    Start from lines others shared for this model and card:
      moe-tune auto-tune MODEL --seed-from you/moe-tune-results
    Which engine (llama.cpp or ik_llama.cpp) for this rig and workload:
      moe-tune auto-tune MODEL --engines llama.cpp,ik
    """
    started = time.monotonic()  # --time counts the whole command
    from tuner.cli.cmd_frontier import run as run_frontier
    from tuner.engine import build, tokenizer
    from tuner.machine import hardware
    from tuner.measure import session
    from tuner.models import demo
    from tuner.report import study_report
    from tuner.search import autotune, study

    if goal not in ("speed", "context"):
        raise UsageError(f"unknown --goal {goal}: use speed or context")
    if goal == "context" and min_ctx is not None:
        raise UsageError("--goal context picks the context itself: drop --min-ctx")
    if max_ctx is not None and not frontier:
        raise UsageError("--max-ctx sets the --frontier ladder: add --frontier")
    if frontier and (pareto or goal == "context" or speculate or draft or prompts):
        raise UsageError("--frontier has its own objectives and ladder: drop --pareto, --goal context and "
                         "--speculation")
    if frontier and seed_from:
        raise UsageError("--seed-from seeds the single-winner search: drop --frontier")
    shown: set[str] = set()  # launch lines the steps already showed whole

    beat: list[Callable[[str], None]] = []  # the heartbeat's say while the machine is held (tuner.cli.heartbeat)

    def say(msg: str) -> None:
        # Steps go to stderr whatever the output: with --json the JSON alone is on stdout, and a run of an hour is
        # followed by its steps all the same.
        if beat:
            beat[0](msg)
        else:
            say_fitted(err, msg, shown)

    load = workload.preset(workload_kind, n_prompt, n_gen, depth_tokens=depth)
    sessions = _sessions(workload_kind, session_file, depth, n_gen, session_rounds, parallel or 1, say)
    path = model_path(model) if model is not None else None  # the demo model is made once the machine is held
    budget = study.Budget(trials=trials if trials is not None or time_limit else autotune.DEFAULT_TRIALS,
                          time_s=study.parse_duration(time_limit) if time_limit else None)
    measure = study.Measure.for_workload(load)
    req = autotune.TuneRequest(model=path or Path("<the demo model>"), workload=load, min_ctx=min_ctx,
                               goal_context=goal == "context",
                               parallel=parallel, max_kld=kv_price.parse_max_kld(max_kld), min_tok_s=min_tok_s,
                               vram_margin_mib=vram_margin, pareto=pareto, budget=budget, measure=measure,
                               storage=storage, results_dir=results_dir, seed=seed,
                               speculation=_speculation(speculate, draft, prompts), device=device_choice(device),
                               session=sessions)
    if req.device == "none" and vram_budget is not None:
        raise UsageError("--vram-budget plans the card and --device none leaves it out: drop one of them")
    locs = build.engines_for(engines, llama_cpp_dir)
    if len(locs) > 1 and trials is None:
        from tuner.versus import engine_run

        req = replace(req, budget=engine_run.split_budget(req.budget, len(locs)))
    loc = locs[0]
    if len(locs) > 1 and (frontier or speculate or draft or prompts):
        raise UsageError("--frontier and --speculation tune one engine: add --engines llama.cpp (or ik)")
    if (frontier or speculate or draft or prompts) and "frontier" not in build.capabilities(loc).kind.stages:
        raise UsageError(f"--frontier and --speculation are measured on llama.cpp only, not "
                         f"{build.capabilities(loc).kind.name}: add --engines llama.cpp")
    if sessions is not None and sessions.session_file is None and path is not None and tokenizer.available(loc):
        # The bundled session in the model's own tokens (its header's vocabulary), before the machine is held.
        session.check_room(depth, sessions.gen_tokens, tokenizer.model_tokenizer(loc, path), path.name)
    with measuring("auto-tune", allow_busy=allow_busy, busy_wait=busy_wait, quiet_output=as_json,
                   device=req.device), beating(lambda m: say_fitted(err, m, shown)) as beat_say:
        beat.append(beat_say)
        if path is None:
            req = replace(req, model=demo.default_model(loc, on_step=say))
        hw = hardware.with_ram_budget(
            hardware.with_vram_budget(hardware.probe_hardware(host_bandwidth_s=0.3), vram_budget), ram)
        say(f"machine: {hw.describe()}" + ("; measuring the CPU on purpose (--device none)"
                                           if req.device == "none" and hw.has_gpu else ""))
        if seed_from:
            from tuner.share.seeds import seeds_from

            req = replace(req, proposals=tuple(seeds_from(seed_from, req.model, hw, on_step=say)))
        if frontier:
            run_frontier(req, loc, hw, max_ctx=max_ctx, trials=trials, as_json=as_json, say=say)
            return
        if len(locs) > 1:
            from tuner.cli.engines_out import tune_engines

            tune_engines(req, locs, hw, as_json, say,
                         lambda r, where, hooks, left: _search(r, where, hw, as_json, say, hooks, left), started)
            return
        result = _search(req, loc, hw, as_json, say)
        if not build.capabilities(loc).kind.numerics_reference and not result.search.interrupted:
            result = _priced(result, loc, req, say)
    study_report.write(result.result, result.result_dir)
    if result.search.interrupted:
        say(f"interrupted: {_kept(result.search.kept)}; run the same command again to resume study "
            f"{result.study_name}")
        raise typer.Exit(130)
    if as_json:
        out.print_json(json.dumps(result.result.to_dict() | {"result_dir": str(result.result_dir)}))
        _refuse_priced(result)
        return
    summary(result)
    if result.session is not None:
        session_summary(result.session)
    chosen = " (chosen by agent session time)" if study_report.deciding_session(result.result) else ""
    if result.result.engine_price:
        say_fitted(out, f"engine price: {result.result.engine_price['note']}")
    _refuse_priced(result)  # before the handover, which refuses such a line in its own words
    named = study_report.launch_line(result.result)
    kind = study_report.engine_of(result.result)
    if not kind.server_on_path:
        chosen += f" ({kind.name}: its own llama-server, by path)"
    out.print(f"launch line{chosen}:", highlight=False, markup=False, soft_wrap=True)
    out.print(named, highlight=False, markup=False, soft_wrap=True)  # whole, on a line of its own, to copy


def _priced(result: autotune.TuneResult, loc: build.EngineLocation, req: autotune.TuneRequest,
            say: Callable[[str], None]) -> autotune.TuneResult:
    """Another engine tuned alone: its printed line priced as it runs against llama.cpp's f16 logits, the price kept in
    its result (:func:`tuner.versus.engine_run.price_single`)."""
    from tuner.core.errors import TunerError
    from tuner.report import study_report
    from tuner.search.result import write_result
    from tuner.search.study import config_from_dict
    from tuner.versus.engine_run import price_single

    picks = study_report.picks(result.result)
    try:
        got, note = price_single(config_from_dict(picks[0].config) if picks else None, loc, req, say)
    except TunerError as exc:
        got, note = None, f"could not be priced ({exc})"
    refused = got is not None and got.refused_by(req.max_kld)
    if refused and got is not None:
        note = f"{note}: above --max-kld {req.max_kld:g}, so this line is not one to run"
    block = (got.to_dict() if got else {}) | {"note": note, "refused": refused}
    say(f"engine price: {note}")
    priced = replace(result.result, engine_price=block)
    write_result(priced, result.result_dir)
    return replace(result, result=priced)


def _refuse_priced(result: autotune.TuneResult) -> None:
    block = result.result.engine_price or {}
    if block.get("refused"):
        raise UsageError(f"the printed line's logits stray from llama.cpp's ({block['note']}): tune with --engines "
                         "llama.cpp, or pass --max-kld off to take this engine's numbers as they are")


def _search(req: autotune.TuneRequest, loc: build.EngineLocation, hw: hardware.Hardware, as_json: bool,
            say: Callable[[str], None], hooks: SearchHooks | None = None,
            left_s: Callable[[], float | None] | None = None) -> autotune.TuneResult:
    """One engine's search with its bar (a terminal) or a line per trial (a log, a pipe, --json). ``hooks``: the
    engines' run's (its time budget, its clock fed each trial); ``left_s``: the run's own estimate of the time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tuner.cli.cmd_frontier import trial_line
    from tuner.search import autotune

    # A terminal gets the bar; a log, a pipe or --json a line per finished trial with the time left (a trial on a
    # 17 GiB model takes minutes: the two-engine chat run once showed nothing for ten of them).
    live = err.is_terminal and not as_json
    start = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, disable=not live, transient=False) as bar:
        task = bar.add_task("search", total=req.budget.trials)  # this engine's share where several are searched

        def on_progress(p: study.Progress) -> None:
            if hooks is not None:
                hooks.on_trial(p)
            best = "n/a" if p.best_request_s is None else f"{p.best_request_s:,.2f} s/request"
            bar.update(task, completed=p.done, description=f"search (best {best}; last: {p.last.status})")
            if not live:
                say(trial_line(p, time.monotonic() - start, req.budget.time_s, left_s() if left_s else None))

        return autotune.auto_tune(req, loc, hw, on_progress=on_progress, on_step=say,
                                  should_stop=hooks.should_stop if hooks is not None else None)


def _kept(kept: dict[str, int]) -> str:
    """What an interrupted search left in the study, in words."""
    if not kept:
        return "no trial of this run is in the study"
    words = {"measured": "measured", "infeasible": "refused by the memory gate", "failed": "failed",
             "interrupted": "cut short by Ctrl-C (to be measured again)",
             "host_paging": "measured while paging host RAM (never candidates)",
             "paging_beside_others": "paged while other programs took RAM (to be measured again)"}
    parts = [f"{n} {words.get(status, status)}" for status, n in sorted(kept.items())]
    return f"kept {sum(kept.values())} trials of this run in the study ({', '.join(parts)})"


def _sessions(kind: workload.WorkloadKind, path: Path | None, depth: int | None, n_gen: int | None,
              rounds: int, agents: int, say: Callable[[str], None]) -> SessionRequest | None:
    """The agent workload's session stage, checked before anything runs (None: no stage). With ``-np N``,
    N agents' sessions run at once, one per slot."""
    from tuner.measure import session
    from tuner.search import session_stage
    from tuner.search.session_stage import SessionRequest

    if kind is not workload.WorkloadKind.AGENT:
        if path is not None:
            raise UsageError("--session replays an agent conversation: add --workload agent")
        return None
    if rounds == 0 and path is None:
        return None
    session_stage.check_rounds(rounds)
    if path is None and depth is not None and depth < session.MIN_DEPTH:
        say(f"no session stage: --depth {depth} leaves no room for a multi-turn session "
            f"(it needs {session.MIN_DEPTH} tokens or more)")
        return None
    gen = n_gen or session.DEFAULT_GEN_TOKENS
    session.session_maker(path, depth, gen)  # a bad file or depth fails now, not after the search
    return SessionRequest(session_file=path, depth_tokens=depth, gen_tokens=gen, rounds=rounds, agents=agents)


def _speculation(on: bool, draft: str | None, prompts: Path | None) -> SpeculationRequest | None:
    from tuner.measure import speculation as spec_measure
    from tuner.search.speculation import SpeculationRequest

    if not (on or draft or prompts):
        return None
    if prompts is not None:
        spec_measure.load_prompts(prompts)  # a bad file fails now, not after the search
    return SpeculationRequest(draft_model=model_path(draft) if draft else None, prompts_file=prompts)


@app.command("launch-line", short_help="Print the measured llama-server line of a result.")
@friendly
def launch_line_cmd(
    result: Annotated[Path, typer.Argument(help="results/<study>/result.json (or the folder).")],
    rank: Annotated[int, typer.Option(
        "--rank", help="1 = the printed line, 2 = the next distinct line: after a race across engines, the race's "
        "other lines in the rule's order, then each search's measured configs; else by the finish's score.")] = 1,
    fmt: Annotated[str, typer.Option(
        "--format", help="shell, llama-swap, systemd (a user unit), compose (the llama.cpp server image), preset "
        "(an INI section for llama-server's router, --models-preset) or json; "
        "what a format cannot carry is written into it.")] = "shell",
    host: Annotated[str | None, typer.Option("--host")] = None,
    port: Annotated[int | None, typer.Option("--port")] = None,
    execute: Annotated[bool, typer.Option("--exec", help="Run the printed llama-server command.")] = False,
    ctx: Annotated[int | None, typer.Option("--ctx", help="The --frontier point at this context.")] = None,
    slots: Annotated[int | None, typer.Option("--slots", help="The --frontier point at this slot count.")] = None,
    llama_cpp_dir: LlamaDir = None,
) -> None:
    """Print the measured llama-server command of a result, rendered by the renderer that measured it.

    \b
    Examples:
      moe-tune launch-line results/<study>/result.json --format llama-swap
    A frontier's point:
      moe-tune launch-line results/<study>/result.json --ctx 32768 --slots 2
    """
    from tuner.engine import build, runner
    from tuner.report import frontier_report, study_report

    data = study_report.load_result(result)
    if ctx is not None or slots is not None:
        if execute or fmt != "shell":
            raise UsageError("--ctx/--slots print the shell line of a frontier point: drop --exec/--format")
        out.print(frontier_report.launch_line(data, ctx, slots, host=host, port=port), highlight=False,
                  soft_wrap=True, markup=False)
        return
    line = study_report.launch_line(data, rank=rank, fmt=fmt, host=host, port=port, llama_cpp_dir=llama_cpp_dir)
    out.print(line, highlight=False, soft_wrap=True, markup=False)
    if execute:
        if fmt != "shell":
            raise UsageError("--exec runs the shell form: drop --format")
        binary = str(build.locate_engine(llama_cpp_dir, study_report.engine_of(data, rank)).tool("llama-server"))
        argv = study_report.launch_argv(data, rank=rank, host=host, port=port, binary=binary)
        runner.run_process(argv, timeout_s=10**9, what="llama-server", fix="check the flags in the launch line",
                           env=study_report.launch_env(data, rank=rank))
