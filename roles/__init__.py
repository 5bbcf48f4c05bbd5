"""pyinfra roles: each package exposes one @deploy that turns plan values into host state."""
