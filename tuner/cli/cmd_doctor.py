"""`moe-tune doctor`."""

from __future__ import annotations

import json

import typer
from rich.text import Text

from tuner.cli.app import JsonFlag, LlamaDir, app, facts_table, friendly, mib, out


@app.command("doctor", short_help="Check engine, GPU, memory and disk; name each fix.")
@friendly
def doctor_cmd(llama_cpp_dir: LlamaDir = None, as_json: JsonFlag = False) -> None:
    """Check the engine, GPU, memory and disk; print each problem with its fix. Exit 0 when tuning can run.

    \b
    Example:
      moe-tune doctor --json
    """
    from tuner.engine import doctor

    report = doctor.diagnose(llama_cpp_dir)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        table = facts_table()
        eng = report.engine
        if eng.get("path"):
            table.add_row("engine", f"{eng['path']} ({eng['source']})")
            pinned = "" if eng["pinned"] else f"; the pin is {eng['pinned_commit']}"
            table.add_row("version", f"{eng['identity']}: build {eng['build_number']}, commit {eng['commit']}{pinned}")
            table.add_row("flags", ", ".join(f"{t}: {len(f)}" for t, f in eng["flags"].items()))
        else:
            table.add_row("engine", Text("not found", style="red"))
        for other in report.engines:  # every engine auto-tune would judge, the one above among them
            where = f"{other['identity']} at {other['path']} ({other['source']})" if other.get("path") else \
                f"not built (`{other['install']}`)"
            table.add_row(f"engine: {other['engine']}", where)
        if report.gpus:
            for gpu in report.gpus:
                table.add_row(
                    f"GPU {gpu['index']}",
                    f"{gpu['name']}: {mib(gpu['total_bytes'])} total, {mib(gpu['free_bytes'])} free, "
                    f"driver {gpu['driver_version']}",
                )
        else:
            table.add_row("GPU", report.gpu_note)
        host = report.host
        table.add_row("RAM", f"{mib(host['ram_total_bytes'])} total, {mib(host['ram_available_bytes'])} available")
        table.add_row("swap", f"{mib(host['swap_total_bytes'])} total, {mib(host['swap_used_bytes'])} used")
        table.add_row("cores", f"{host['physical_cores']} physical, {host['logical_cores']} logical")
        for name, disk in report.disk.items():
            table.add_row(f"disk ({name})", f"{mib(disk['free_bytes'])} free at {disk['path']}")
        out.print(table)
        for problem in report.problems:
            style = "red" if problem.fatal else "yellow"
            out.print(Text.assemble(("problem:", style), f" {problem.what}\n  fix: {problem.fix}"), highlight=False)
        if not report.problems:
            out.print(Text("no problems found", style="green"))
    if not report.ok:
        raise typer.Exit(1)
