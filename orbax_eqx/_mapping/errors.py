"""The mapping's exceptions."""

from .._errors import OrbaxEqxError


class BridgeError(OrbaxEqxError, ValueError):
    """A mapping does not fit the tree or the tensors it is applied to.

    The message lists every problem at once, each naming the tensor and the
    leaf, then the fixes that would work.
    """


class MappingError(BridgeError):
    """A state_dict mapping (its JSON, or a call of its builder) breaks the
    mapping's rules; the message names the rule and what it must be."""


class RenameError(MappingError):
    """Renames (`EqxRestore(renames=)`, a `--rename` file) that are malformed,
    match no name, or make two names one."""
