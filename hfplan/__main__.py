"""`python -m hfplan` runs the command line, as the `hfplan` script does."""

from hfplan.cli import app

app(prog_name="hfplan")
