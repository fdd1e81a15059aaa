"""`python -m orbax_eqx ...`: see `orbax_eqx._cli.main`."""

from ._cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
