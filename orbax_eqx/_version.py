"""The package's version, in a module of its own so that the command line can
name it without importing the package's top level (see `pyproject.toml`'s
import contracts: nothing inside the package imports `orbax_eqx` itself)."""

__version__ = "0.1.0"
