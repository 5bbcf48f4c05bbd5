"""pyinfra roles: each package exposes one @deploy that turns plan values into host state."""


def jinja_options() -> dict:
    """Jinja settings for every template a role renders: block tags leave no blank lines behind.

    A fresh dict each call: pyinfra pops keys from the one it is given.
    """
    return {"trim_blocks": True, "lstrip_blocks": True}
