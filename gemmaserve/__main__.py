"""The `gemmaserve` command (and `python -m gemmaserve`): the operator's CLI, gemmaserve.ops.cli, with the
sandbox's commands plugged in (ops never imports the sandbox; the sandbox may import ops)."""

from gemmaserve.ops.cli import app
from gemmaserve.sandbox.cli import plug_into

plug_into(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
