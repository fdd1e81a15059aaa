"""What the last check before a commit costs: does Orbax's store still hold
every array the save gave it?

    python benchmarks/commit_check.py [--only a,b] [--repeats 5] [--dir DIR]

Before Orbax commits a step, each save lists Orbax's array store and reads the
first byte of every value in it (`_stored_check.missing_in_store`, called by
`_save.claim.before_commit`): another save of the same step may have deleted some
of its files. This saves each benchmark model with `pack=False` (every array
in Orbax's store: the most the check can have to do), times the check on the
saved store (page cache warm, as it is just after a save), and prints it
beside the time of a save (the second, after the first compiled the sums).
A benchmark, not a test: it prints.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402
from etils import epath  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from orbax_eqx._format.sidecar import STORED, arrays_dir  # noqa: E402
from orbax_eqx._storage.orbax_store.keys import missing_in_store  # noqa: E402
from orbax_eqx._tree.names import storage_key  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="a,b", help="models, e.g. a,b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (local disk)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="oeqx-commit-check-", dir=args.dir)
    try:
        for name in args.only.split(","):
            item = _models.build(name)
            path = os.path.join(work, name)
            oeqx.save(path + "-first", item, pack=False)  # compiles the sums
            began = time.perf_counter()
            oeqx.save(path, item, pack=False)
            save_s = time.perf_counter() - began
            saved = oeqx.metadata(path)
            keys = [
                storage_key(leaf.name)
                for leaf in saved.leaves.values()
                if leaf.data == STORED
            ]
            store = arrays_dir(epath.Path(path), saved.token)
            times = []
            for _ in range(args.repeats):
                began = time.perf_counter()
                missing = missing_in_store(store, keys)
                times.append(time.perf_counter() - began)
                assert missing == [], missing
            check_s = statistics.median(times)
            print(
                f"{_models.MODELS[name].label}: {len(keys)} arrays in Orbax's store; "
                f"check {check_s * 1000:.1f} ms (median of {args.repeats}), "
                f"a save (its check included) {save_s:.2f} s, "
                f"check/save {check_s / save_s:.3f}"
            )
            shutil.rmtree(path)
            shutil.rmtree(path + "-first")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
