"""Helpers the tests share (none is a test module): CLI runs, processes, plans, Ray, spawned worlds."""
