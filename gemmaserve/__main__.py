"""`python -m gemmaserve` runs the CLI."""

from gemmaserve.cli import app

app()
