"""`python -m orbax_eqx ...`: see `orbax_eqx._tools.cli`."""

from ._tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
