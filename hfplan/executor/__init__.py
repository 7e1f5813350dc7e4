"""`hfplan execute`: runs a Plan for real on Ray (single controller) with torch.distributed workers.

Needs the `execute` extra (torch, ray, transformers). Outside this package only the profiler imports it (it
measures the engines the executor runs), and it never imports the simulator or the planner: it runs the
plan, it does not re-derive it.
"""
