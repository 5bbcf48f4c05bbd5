"""The one template renderer: role templates render as pyinfra's `files.template` renders them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2


def render(template: Path, **context: Any) -> str:
    """Strict (an undefined name is an error) and with the template's trailing newline kept."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template(template.name).render(**context)
