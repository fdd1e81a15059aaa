"""A failed restore touches nothing: every file and directory under a root,
with its mode, mtime and bytes, is the same before and after."""

import os

import pytest

import orbax_eqx as oeqx


def snapshot(root) -> dict:
    """Every file and directory under `root`: mode, mtime and (files) bytes."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = None
            if name in filenames and not os.path.islink(path):
                with open(path, "rb") as f:
                    data = f.read()
            found[os.path.relpath(path, root)] = (st.st_mode, st.st_mtime_ns, data)
    st = os.stat(root)
    found["."] = (st.st_mode, st.st_mtime_ns, None)
    return found


def fails_touching_nothing(root, path, error, match, skeleton=None, **options):
    """Restores `path`, expects `error` matching `match`; nothing under `root` changes.

    `root` holds the checkpoint and its parent, so a file written next to the
    checkpoint, or anywhere else in the test's directory, is caught too.
    """
    before = snapshot(root)
    with pytest.raises(error, match=match):
        oeqx.restore(path, skeleton, **options)
    assert snapshot(root) == before
    return before
