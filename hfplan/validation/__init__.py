"""`hfplan validate`: a plan's simulated iteration set against the same plan executed, call by call."""
