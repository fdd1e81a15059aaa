"""The command line as users get it: the `orbax-eqx` console script that the
package installs (`[project.scripts]`), loaded through its entry point, so
that the tests run what the installed command runs, not a private module."""

from importlib.metadata import entry_points

(_SCRIPT,) = entry_points(group="console_scripts", name="orbax-eqx")
main = _SCRIPT.load()  # main(argv) -> exit status, as the command runs it
