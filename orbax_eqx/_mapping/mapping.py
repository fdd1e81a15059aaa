"""`StateDictMapping`: a list of rules, its JSON `{"format", "version", "rules"}`
decoded by one msgspec tagged union (`rules.Rule`), which checks every key,
type and bound."""

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Self

import msgspec
import numpy as np
from etils import epath

from .._bytes import files as _files
from .._bytes.route import is_remote
from .._tree.walk import walk
from .errors import MappingError
from .rules import NAMES_ONLY, Rule
from .rules.drop import Ignore
from .rules.field_keys import FieldKeys
from .rules.rename import Rename
from .templates import escape

FORMAT = "orbax_eqx.state_dict_mapping"
VERSION = 1
MAX_JSON_BYTES = 16 << 20  # far more than any mapping: thousands of rules
MAX_RULES = 10_000


class _File(msgspec.Struct, forbid_unknown_fields=True):
    """A mapping's JSON."""

    format: Literal["orbax_eqx.state_dict_mapping"]
    version: Literal[1]
    rules: "_Rules"


_Rules = Annotated[list[Rule], msgspec.Meta(max_length=MAX_RULES)]


def _rule(data: dict, where: str) -> Rule:
    """A rule from its JSON data, checked by the union's decoder."""
    try:
        return msgspec.convert(data, Rule)
    except msgspec.ValidationError as e:
        raise MappingError(f"{where}: {_why(e)}.") from None


def _why(e: Exception) -> str:
    """msgspec's message, with our own errors' text as they were."""
    text = str(e)
    return text[:-1] if text.endswith(".") else text


@dataclasses.dataclass(frozen=True)
class StateDictMapping:
    """How an Equinox tree's leaves map to the tensors of another layout (a
    PyTorch `state_dict`, a Hugging Face checkpoint), declared once and used
    both ways: by `oeqx.to_state_dict` and `oeqx.export_safetensors` (leaves
    to tensors), by `oeqx.from_state_dict` and `oeqx.load_safetensors`
    (tensors into leaves; the inverse is derived), and by a restore
    (`EqxRestore(renames=)`: the skeleton's leaves to the checkpoint's).

    A mapping is a list of rules, applied in order from the leaves' names
    (`blocks.attn.qkv.weight`, as `python -m orbax_eqx inspect` shows them)
    towards the other side's names (the files' names, as `save_pretrained`
    writes them). Each builder method returns a new mapping with one more
    rule:

    !!! example

        ```python
        mapping = (
            oeqx.StateDictMapping()
            .rename({"embed": "wte", "pos_embed": "wpe", "norm": "ln_f"})
            .stack("blocks", "h.{i}")
            .transpose("h.{i}.mlp.c_*.weight")
        )
        ```

    Names in rules are templates: `{i}` stands for a layer index (and is
    repeated where a rule writes names), `*` for any text within one part of a
    name and `**` for any text (only where a rule selects tensors). `{{`,
    `}}` and `{*}` are a literal `{`, `}` and `*`. A template has at most two
    wildcards, and text between any two holes or wildcards. Each rule sees
    the names the rules before it made, and every rule must match something
    (except `ignore` and `tie`).

    `to_json()` gives the mapping as JSON data, which `from_json` reads back.
    """

    rules: tuple[Rule, ...] = ()

    def _with(self, data: dict, where: str) -> Self:
        return dataclasses.replace(self, rules=self.rules + (_rule(data, where),))

    def rename(
        self, names: str | Mapping[str, str | None], new: str | None = None
    ) -> Self:
        """Renames leaves, or whole subtrees of them.

        **Arguments:**

        - `names`: a name, or a dict `{name: new name}`. A name renames itself
            and every name it is the leading parts of (`"embed"` renames
            `embed.weight` to `wte.weight`, not `embedding`); the longest entry
            that fits wins. Holes like `{i}` match layer indices and may be
            repeated in the new name. A new name of `None` leaves the names
            out (like `drop`); `""` removes the parts that matched.
        - `new`: the new name, when `names` is one name.
        """
        table = {names: new} if isinstance(names, str) else dict(names)
        return self._with({"op": "rename", "names": table}, ".rename()")

    def rename_regex(
        self, rules: str | Sequence[tuple[str, str | None]], new: str | None = None
    ) -> Self:
        """Renames by regular expressions: the first pattern that matches a whole
        name gives its new name (`\\1` is the first group, `\\g<name>` a named
        one).

        **Arguments:**

        - `rules`: a pattern, or a list of `(pattern, new name)` pairs. A new
            name of `None` leaves the names out. Patterns are RE2's (linear
            time, whatever the pattern and the name): Python's syntax without
            backreferences or lookarounds, `\\d` and `\\w` matching ASCII.
        - `new`: the new name, when `rules` is one pattern.
        """
        pairs = [(rules, new)] if isinstance(rules, str | re.Pattern) else rules
        listed = [
            [p.pattern if isinstance(p, re.Pattern) else p, n]
            for p, n in (_pair(r) for r in pairs)
        ]
        return self._with({"op": "rename_regex", "rules": listed}, ".rename_regex()")

    def field_keys(self, key: str = "state_dict_key") -> Self:
        """Renames each field declared `eqx.field(metadata={key: "name"})` to
        that name, wherever its module is in the tree (`""` leaves the field's
        part out). Needs the tree: `to_state_dict` and `from_state_dict` read it
        from theirs; `resolve` turns the keys into plain renames."""
        return self._with({"op": "field_keys", "key": key}, ".field_keys()")

    def stack(self, leaves: str, tensors: str) -> Self:
        """A leading layer axis of leaves ⇄ one tensor per layer.

        **Arguments:**

        - `leaves`: the name of the stacked leaves' subtree, such as `"blocks"`
            (a module made with `eqx.filter_vmap`): every leaf under it has
            the layers on its first axis.
        - `tensors`: the tensors' names, with a hole for the index, such as
            `"h.{i}"`: `blocks.attn.w` of shape (L, ...) ⇄ `h.0.attn.w` ...
            `h.{L-1}.attn.w`. Two new holes (`"g.{i}.l.{j}"`) unstack two
            leading axes, in the order they appear; holes of `leaves` (from an
            earlier `stack`) are carried over, so stacks nest.
        """
        return self._with({"op": "stack", "from": leaves, "to": tensors}, ".stack()")

    def transpose(
        self, match: str | Sequence[str], perm: Sequence[int] | None = None
    ) -> Self:
        """The tensors matched hold their axes in another order:
        `tensor == x.transpose(perm)` of `x`, what the rules before made
        (GPT-2's `Conv1D` weights are (in, out) where `eqx.nn.Linear` has
        (out, in)).

        **Arguments:**

        - `match`: a name template, or a list of them (wildcards allowed).
        - `perm`: the permutation, as `numpy.transpose` takes it; `None`
            reverses the axes.
        """
        data = {"op": "transpose", "match": _names(match), "perm": _ints(perm)}
        return self._with(data, ".transpose()")

    def reshape(self, match: str | Sequence[str], shape: Sequence[int]) -> Self:
        """The tensors matched hold the same values in another shape:
        `tensor == x.reshape(shape)` (one `-1` is inferred), such as ViT's
        `cls_token` of shape (1, 1, D) for a leaf of shape (D,):
        `.reshape("cls_token", [1, 1, -1])`."""
        data = {"op": "reshape", "match": _names(match), "shape": _ints(shape)}
        return self._with(data, ".reshape()")

    def squeeze(
        self, match: str | Sequence[str], axes: int | Sequence[int] | None = None
    ) -> Self:
        """The tensors matched lack the axes `axes` of length 1 (`None`: every
        axis of length 1), as `numpy.squeeze` gives: `eqx.nn.Conv2d` keeps its
        bias as (D, 1, 1) where PyTorch has (D,)."""
        axes = [axes] if isinstance(axes, int) else axes
        data = {"op": "squeeze", "match": _names(match), "axes": _ints(axes)}
        return self._with(data, ".squeeze()")

    def expand_dims(
        self, match: str | Sequence[str], axes: int | Sequence[int]
    ) -> Self:
        """The tensors matched have axes of length 1 inserted at `axes`, as
        `numpy.expand_dims` gives: ViT's (1, N+1, D) position embeddings for
        a leaf of (N+1, D) are `.expand_dims("pos_embed", 0)`."""
        axes = [axes] if isinstance(axes, int) else axes
        data = {"op": "expand_dims", "match": _names(match), "axes": _ints(axes)}
        return self._with(data, ".expand_dims()")

    def split(
        self,
        match: str,
        into: Sequence[str],
        *,
        axis: int,
        sizes: Sequence[int] | None = None,
    ) -> Self:
        """One tensor of the leaves' side is several tensors: its parts along
        `axis` (a fused qkv projection ⇄ separate q, k, v).

        **Arguments:**

        - `match`: the tensor to split, a name template (`"h.{i}.attn.qkv"`).
        - `into`: the parts' names, in order along the axis; they may repeat
            the holes of `match`.
        - `axis`: the axis to split (negative counts from the end).
        - `sizes`: each part's size along the axis (unequal for grouped-query
            attention); `None` splits into equal parts.
        """
        data = {
            "op": "split",
            "match": match,
            "axis": axis,
            "into": _names(into),
            "sizes": _ints(sizes),
        }
        return self._with(data, ".split()")

    def fuse(self, parts: Sequence[str], into: str, *, axis: int) -> Self:
        """Several tensors of the leaves' side are one tensor: the parts,
        concatenated along `axis` in the order given (separate q, k, v ⇄
        GPT-2's fused `c_attn`).

        **Arguments:**

        - `parts`: the parts' names, templates with the same holes (no
            wildcards).
        - `into`: the fused tensor's name, with those holes.
        - `axis`: the axis to concatenate along.
        """
        data = {"op": "fuse", "parts": _names(parts), "axis": axis, "into": into}
        return self._with(data, ".fuse()")

    def cast(self, match: str | Sequence[str], dtype: Any) -> Self:
        """Writes the tensors matched in `dtype` (such as `"bfloat16"`); loads
        take that dtype as expected and cast back to the leaves' own."""
        name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        return self._with(
            {"op": "cast", "match": _names(match), "dtype": name}, ".cast()"
        )

    def drop(self, match: str | Sequence[str]) -> Self:
        """Leaves the names matched out of the tensors. A load keeps those
        leaves' values from the skeleton, which must then hold arrays (not
        `jax.ShapeDtypeStruct`s)."""
        return self._with({"op": "drop", "match": _names(match)}, ".drop()")

    def ignore(self, match: str | Sequence[str]) -> Self:
        """Tensors a load leaves alone (buffers such as GPT-2's `attn.bias`
        masks or `rotary_emb.inv_freq`), by their final names; matching none
        is no error."""
        return self._with({"op": "ignore", "match": _names(match)}, ".ignore()")

    def tie(self, tensor: str, to: str, *, export: bool = False) -> Self:
        """The tensor `tensor` is a copy of the tensor `to` (a tied output
        head: GPT-2's `lm_head.weight` and `wte.weight`). A load accepts it
        when present and checks it holds the same values; with `export=True`,
        exports write it too."""
        data = {"op": "tie", "tensor": tensor, "to": to, "export": export}
        return self._with(data, ".tie()")

    def resolve(self, tree: Any) -> Self:
        """This mapping with the tree's field keys (`field_keys`) written out as
        plain renames, so that it works on names alone: on a checkpoint
        exported by path, without the model's classes.

        **Arguments:**

        - `tree`: the model, or a skeleton of it (`eqx.filter_eval_shape`).
        """
        if not any(isinstance(r, FieldKeys) for r in self.rules):
            return self
        walked = walk(tree)
        rules = tuple(
            r.resolve(tree, walked) if isinstance(r, FieldKeys) else r
            for r in self.rules
        )
        return dataclasses.replace(self, rules=rules)

    @property
    def names_only(self) -> bool:
        """Whether every rule only renames (or ignores): then applying the
        mapping needs names alone, no shapes."""
        return all(isinstance(r, NAMES_ONLY) for r in self.rules)

    def to_json(self) -> dict[str, Any]:
        """The mapping as JSON data (`json.dumps` it to save it)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "rules": msgspec.to_builtins(list(self.rules)),
        }

    @classmethod
    def from_json(cls, data: Any) -> "StateDictMapping":
        """Reads a mapping from JSON data or text (what `to_json` gives).

        Also reads two shorthands: an object of names `{"old": "new" or
        null}` (one `rename` rule of those exact names) and a list of
        `[regex, new name or null]` pairs (one `rename_regex` rule). Unknown
        keys, wrong types and out-of-range numbers raise `MappingError`,
        saying where.
        """
        if isinstance(data, str | bytes):
            data = _parse_text(data)
        if isinstance(data, Mapping) and "rules" in data and "format" in data:
            try:
                decoded = msgspec.convert(data, _File)
            except msgspec.ValidationError as e:
                raise MappingError(
                    f"The mapping is not one this orbax_eqx reads ({_why(e)}): a "
                    f'mapping is {{"format": "{FORMAT}", "version": {VERSION}, '
                    '"rules": [...]}.'
                ) from None
            return cls(tuple(decoded.rules))
        if isinstance(data, Mapping):
            return cls((names_rule(data, "The rename map"),))
        if isinstance(data, list) and data and isinstance(data[0], list):
            try:
                rule = msgspec.convert({"op": "rename_regex", "rules": data}, Rule)
            except msgspec.ValidationError as e:
                # Where in the list, not in the rule it stands for.
                why = _why(e).replace("at `$.rules", "at `$")
                raise MappingError(f"The rename map: {why}.") from None
            return cls((rule,))
        if isinstance(data, list):  # the rules alone
            try:
                rules = msgspec.convert(data, _Rules)
            except msgspec.ValidationError as e:
                raise MappingError(
                    f"The mapping's rules: {_why(e)}. Each rule is an object "
                    '{"op": ...}; a rename map is {"old": "new" or null}, or '
                    '[["regex", "new" or null]].'
                ) from None
            return cls(tuple(rules))
        raise MappingError(
            "A mapping is a JSON object "
            f'{{"format": "{FORMAT}", "version": {VERSION}, "rules": [...]}}, or a '
            'rename map ({"old": "new" or null}, or [["regex", "new" or null]]); '
            f"this is {type(data).__name__}."
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "StateDictMapping":
        """Reads the mapping in the JSON file at `path` (local, `gs://`, `s3://`),
        at most 16 MiB: the full form or a shorthand, as `from_json` reads
        them. The command line's `--rename` and `--mapping` files are these."""
        source = os.fspath(path)

        def refused(what: str) -> MappingError:
            return MappingError(
                f"The mapping {source} {what}. Pass the path of a JSON file."
            )

        where = epath.Path(source) if is_remote(source) else source
        try:
            data = _files.read_bounded(where, MAX_JSON_BYTES, refused)
        except FileNotFoundError:
            raise refused("does not exist") from None
        try:
            return cls.from_json(data)
        except MappingError as e:
            raise MappingError(f"In {source}: {e}") from None


def names_rule(table: Mapping, where: str) -> Rename:
    """The `rename` rule of a rename map `{"old": "new" or null}` of exact names."""
    bad = [k for k, v in table.items() if not isinstance(k, str) or not _is_new(v)]
    if bad:
        raise MappingError(
            f"{where} maps {bad[0]!r} to {table[bad[0]]!r}: a rename map maps "
            "names (str) to new names (str), or to null to leave them out."
        )
    names = {escape(k): (None if v is None else escape(v)) for k, v in table.items()}
    rule = _rule({"op": "rename", "names": names}, where)
    assert isinstance(rule, Rename)
    return rule


def from_old_names(table: Mapping, where: str) -> StateDictMapping:
    """The mapping a migration's `{old name: new name or None}` stands for,
    read the other way: each new name renamed to its old one, and the old
    names mapped to None ignored (left unread)."""
    names_rule(table, where)  # checks the table
    olds: dict[str, str] = {}
    for old, new in table.items():
        if new is not None and olds.setdefault(new, old) != old:
            raise MappingError(
                f"{where} maps both {olds[new]!r} and {old!r} to {new!r}: a new name "
                "is read from one old name. Give each its own new name, or map one "
                "to None to leave it unread."
            )
    renames: dict[str, str | None] = {
        escape(new): escape(old)
        for old, new in table.items()
        if new is not None and new != old
    }
    ignored = [escape(old) for old, new in table.items() if new is None]
    rules: list[Rule] = []
    if renames:
        rules.append(Rename(renames))
    if ignored:
        rules.append(Ignore(ignored))
    return StateDictMapping(tuple(rules))


def _is_new(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _parse_text(data: str | bytes) -> Any:
    if len(data) > MAX_JSON_BYTES:
        raise MappingError(
            f"The mapping is {len(data)} bytes long, more than the "
            f"{MAX_JSON_BYTES >> 20} MiB a mapping may have."
        )
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:
        raise MappingError(f"The mapping is not valid JSON ({e}).") from None


def _pair(rule: Any) -> tuple[Any, Any]:
    if isinstance(rule, Sequence) and not isinstance(rule, str) and len(rule) == 2:
        return rule[0], rule[1]
    raise MappingError(
        f"`.rename_regex()` takes (pattern, new name) pairs, not {rule!r:.80}."
    )


def _names(value: Any) -> Any:
    if isinstance(value, str) or not isinstance(value, Sequence):
        return value  # refused by the rule's decoder, with its message
    return list(value)


def _ints(value: Any) -> Any:
    if value is None or isinstance(value, str) or not isinstance(value, Sequence):
        return value
    return [int(v) if isinstance(v, np.integer) else v for v in value]


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise MappingError(f"`cast` takes a dtype, not {dtype!r}.") from None
