"""`copy`: a self-contained copy of a step saved with `dedup=True`
(`oeqx.copy_step`)."""

from .._format.locate import as_path
from .._storage.shared import copy_step
from .render import count


def run(args) -> int:
    step, out = as_path(args.step), as_path(args.out)
    copied = copy_step(step, out)
    held = (
        f"with {count(len(copied), 'shared pack')} copied in" if copied else "as it was"
    )
    print(f"Copied {step} to {out}, {held}: it holds every byte it needs.")
    return 0
