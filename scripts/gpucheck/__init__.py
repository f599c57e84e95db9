"""The GPU check (`scripts/gpu_check`, entry point :func:`gpucheck.check.main`) as one package: the steps and their
estimates (steps), how they fall into a lease's commands (lease), the CUDA engine on the device (engine, pack),
what each step measures (memory, spill, tune, opoff), leftovers of a cut command (procs) and the table (table)."""
