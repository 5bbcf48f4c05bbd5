"""`python -m gemmaserve` runs the CLI."""

from gemmaserve.ops.cli import app

app()
