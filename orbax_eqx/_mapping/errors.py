"""The mapping's exceptions."""

from .._errors import BridgeError as BridgeError


class MappingError(BridgeError):
    """A state_dict mapping (its JSON, or a call of its builder) breaks the
    mapping's rules; the message names the rule and what it must be."""


class RenameError(MappingError):
    """Renames (`EqxRestore(renames=)`, a `--rename` file) that are malformed,
    match no name, or make two names one."""
