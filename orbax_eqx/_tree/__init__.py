"""The tree: Equinox PyTrees walked into named leaves.

Owns leaf names (`names`), how Python values are written as JSON (`values`),
the walk of a tree into (leaf path, leaf name, kind) records (`walk`), how
the walk names its leaves and `eqx.nn.State` entries (`namer`), and
the records of its inner nodes that a rebuild needs (`nodes`).
May import: `orbax_eqx._errors` and nothing else of ours.
"""
