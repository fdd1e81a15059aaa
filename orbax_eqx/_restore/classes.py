"""Why a class (or a named callable) differs between the skeleton and a checkpoint.

Classes and callables are recorded as `module.qualname`. The usual difference
that is no change at all is the same class under another module name: a script
run as `python train.py` names its classes `__main__.Model`, while a program
that imports the script sees `train.Model`.
"""


def same_name_elsewhere(mine: str, theirs: str) -> tuple[str, str, str] | None:
    """`(name, my module, their module)` if the two qualified names end in the same
    name in different modules: `mymodule.Model` and `__main__.Model` give
    `("Model", "mymodule", "__main__")`."""
    a, b = mine.split("."), theirs.split(".")
    n = 0
    while n < min(len(a), len(b)) - 1 and a[-1 - n] == b[-1 - n]:
        n += 1
    if n == 0 or a[:-n] == b[:-n]:
        return None
    return ".".join(a[-n:]), ".".join(a[:-n]), ".".join(b[:-n])


def explain(mine: str, theirs: str, where: str = "the checkpoint") -> str:
    """A clause saying how the skeleton's `mine` and `theirs` (saved in `where`)
    differ, to end a sentence with; empty if they are simply different."""
    found = same_name_elsewhere(mine, theirs)
    if found is None:
        return ""
    name, here, there = found
    if there == "__main__":
        return (
            f": the same name `{name}` in another module, as when a script run "
            f"directly (so its module is `__main__`) saved {where} and `{name}` is "
            f"now imported from `{here}`"
        )
    if here == "__main__":
        return (
            f": the same name `{name}` in another module, as when {where} was saved "
            f"with `{name}` imported from `{there}` and a script run directly (so "
            "its module is `__main__`) now defines it"
        )
    return (
        f": the same name `{name}` in another module (`{there}` when saved, "
        f"`{here}` now), as when a module is moved or renamed"
    )
