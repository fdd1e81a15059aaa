"""The tree: Equinox PyTrees walked into named leaves.

Owns `names`, `values` (Python values as JSON), `walk`, `namer` and `nodes`.
May import: `orbax_eqx._errors` and nothing else of ours.
"""
