"""The profiler behind `hfplan profile`: measures the machine at hand and writes a hardware profile.

Modules, one job each: device (what the machine is), sweeps (what to measure), timing (how to time
it), compute (matmuls, memory and host copies), comm (collectives across processes), layers (the real
transformer layer against the cost model), fit (alpha-beta and roofline fits), build (fitted rates to
the profile schema), run (one profiling run), report (rich tables), command (the typer command).
Only `command` is imported by the CLI, and it imports torch lazily.
"""
