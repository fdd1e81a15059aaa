"""`StateDictMapping`: how leaf names and shapes become another layout's tensors.

A mapping is a list of rules (`transforms/`), applied in order from the
leaves towards the tensors; loading uses the same rules (the planner derives
the inverse). It is data: `to_json` / `from_json` round-trip exactly, and
the JSON is read as an allow list (`transforms/schema.py`).
"""

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np

from .._bytes.paths import is_remote
from .._tree.walk import walk
from .errors import MappingError
from .templates import escape
from .transforms import RULES, Rule
from .transforms.drop import Ignore
from .transforms.field_keys import FieldKeys
from .transforms.rename import Rename
from .transforms.rename_regex import RenameRegex

FORMAT = "orbax_eqx.state_dict_mapping"
VERSION = 1
MAX_JSON_BYTES = 16 << 20  # far more than any mapping: thousands of rules
MAX_RULES = 10_000


def _builder(where: str, data: dict) -> Rule:
    """A rule made by a builder method, checked as its JSON would be."""
    return RULES[data["op"]].from_json(data, where)


@dataclasses.dataclass(frozen=True)
class StateDictMapping:
    """How an Equinox tree's leaves map to the tensors of another layout (a
    PyTorch `state_dict`, a Hugging Face checkpoint), declared once and used
    both ways: by `oeqx.to_state_dict` (leaves to tensors) and by
    `oeqx.from_state_dict` (tensors into leaves; the inverse is derived).

    A mapping is a list of rules, applied in order from the leaves' names
    (`blocks.attn.qkv.weight`, as `python -m orbax_eqx inspect` shows them)
    towards the tensors' names. Each builder method returns a new mapping
    with one more rule:

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
    name and `**` for any text (only where a rule selects tensors:
    `transpose`, `split`, `cast`, `drop`, `ignore`). `{{`, `}}` and `{*}` are
    a literal `{`, `}` and `*`. A template has at most two wildcards, and
    text between any two holes or wildcards. Each rule sees the names the
    rules before it made, and every rule must match something (except
    `ignore` and `tie`).

    `to_json()` gives the mapping as JSON data, which `from_json` reads back
    (also the rename maps of `export --rename`: an object of names, or a list
    of `[regex, new name]` rules).
    """

    rules: tuple[Rule, ...] = ()

    def _with(self, rule: Rule) -> Self:
        return dataclasses.replace(self, rules=self.rules + (rule,))

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
        if isinstance(names, str):
            table: Any = {names: new}
        else:
            table = dict(names) if isinstance(names, Mapping) else names
        return self._with(_builder(".rename()", {"op": "rename", "names": table}))

    def rename_regex(
        self, rules: str | Sequence[tuple[str, str | None]], new: str | None = None
    ) -> Self:
        """Renames by regular expressions: the first pattern that matches a whole
        name gives its new name (`re.Match.expand`: `\\1` is the first group).

        **Arguments:**

        - `rules`: a pattern, or a list of `(pattern, new name)` pairs. A new
            name of `None` leaves the names out. Patterns that could backtrack
            without end (a repeat of a repeat, a repeated choice,
            backreferences, lookarounds, more than 4 repetitions) are refused.
        - `new`: the new name, when `rules` is one pattern.
        """
        pairs = [(rules, new)] if isinstance(rules, str) else rules
        return self._with(
            _builder(
                ".rename_regex()",
                {"op": "rename_regex", "rules": [list(p) for p in pairs]},
            )
        )

    def field_keys(self, key: str = "state_dict_key") -> Self:
        """Renames each field declared `eqx.field(metadata={key: "name"})` to
        that name, wherever its module is in the tree (`""` leaves the field's
        part out). Needs the tree: `to_state_dict` and `from_state_dict` read it
        from theirs; `resolve` turns the keys into plain renames."""
        return self._with(_builder(".field_keys()", {"op": "field_keys", "key": key}))

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
        return self._with(
            _builder(".stack()", {"op": "stack", "from": leaves, "to": tensors})
        )

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
        return self._with(_builder(".transpose()", data))

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
            "into": _names(into, one=False),
            "sizes": _ints(sizes),
        }
        return self._with(_builder(".split()", data))

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
        data = {"op": "fuse", "parts": _names(parts, one=False), "axis": axis}
        data["into"] = into
        return self._with(_builder(".fuse()", data))

    def cast(self, match: str | Sequence[str], dtype: Any) -> Self:
        """Writes the tensors matched in `dtype` (such as `"bfloat16"`); loads
        take that dtype as expected and cast back to the leaves' own."""
        name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        data = {"op": "cast", "match": _names(match), "dtype": name}
        return self._with(_builder(".cast()", data))

    def drop(self, match: str | Sequence[str]) -> Self:
        """Leaves the names matched out of the tensors. A load keeps those
        leaves' values from the skeleton, which must then hold arrays (not
        `jax.ShapeDtypeStruct`s)."""
        return self._with(_builder(".drop()", {"op": "drop", "match": _names(match)}))

    def ignore(self, match: str | Sequence[str]) -> Self:
        """Tensors a load leaves alone (buffers such as GPT-2's `attn.bias`
        masks or `rotary_emb.inv_freq`), by their final names; matching none
        is no error."""
        data = {"op": "ignore", "match": _names(match)}
        return self._with(_builder(".ignore()", data))

    def tie(self, tensor: str, to: str, *, export: bool = False) -> Self:
        """The tensor `tensor` is a copy of the tensor `to` (a tied output
        head: GPT-2's `lm_head.weight` and `wte.weight`). A load accepts it
        when present and checks it holds the same values; with `export=True`,
        exports write it too."""
        data = {"op": "tie", "tensor": tensor, "to": to, "export": export}
        return self._with(_builder(".tie()", data))

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

    def to_json(self) -> dict[str, Any]:
        """The mapping as JSON data (`json.dumps` it to save it)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "rules": [r.to_json() for r in self.rules],
        }

    @classmethod
    def from_json(cls, data: Any) -> "StateDictMapping":
        """Reads a mapping from JSON data or text (what `to_json` gives).

        Also reads the rename maps of `export --rename`: an object of names
        `{"old": "new" or null}` (a `rename` rule), or a list of
        `[regex, new name or null]` rules (a `rename_regex` rule).
        Unknown keys, wrong types and out-of-range numbers raise
        `MappingError`, naming the rule.
        """
        if isinstance(data, str | bytes):
            data = _parse_text(data)
        if isinstance(data, Mapping) and "format" in data and "rules" in data:
            extra = sorted(set(data) - {"format", "version", "rules"}, key=str)
            if extra:
                raise MappingError(
                    f"The mapping has the unknown key {extra[0]!r}: a mapping is "
                    '{"format", "version", "rules"}.'
                )
            if data["format"] != FORMAT or data.get("version") != VERSION:
                raise MappingError(
                    f"The mapping is format {data['format']!r} version "
                    f"{data.get('version')!r}; this orbax_eqx reads {FORMAT!r} "
                    f"version {VERSION}."
                )
            return cls(_rules(data["rules"]))
        if isinstance(data, Mapping):  # a rename map: {"old": "new" or null}
            if all(isinstance(k, str) for k in data) and all(
                isinstance(v, str | None) for v in data.values()
            ):
                names = {
                    escape(k): (None if v is None else escape(v))
                    for k, v in data.items()
                }
                return cls(
                    (
                        Rename.from_json(
                            {"op": "rename", "names": names}, "The rename map"
                        ),
                    )
                )
        if isinstance(data, list) and data and all(isinstance(r, list) for r in data):
            return cls(
                (
                    RenameRegex.from_json(
                        {"op": "rename_regex", "rules": data}, "The rename map"
                    ),
                )
            )
        if isinstance(data, list):
            return cls(_rules(data))
        raise MappingError(
            "A mapping is a JSON object "
            f'{{"format": "{FORMAT}", "version": {VERSION}, "rules": [...]}}, or a '
            'rename map ({"old": "new" or null}, or [["regex", "new" or null]]); '
            f"this is {type(data).__name__}."
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "StateDictMapping":
        """Reads the mapping in the JSON file at `path` (local, `gs://`, `s3://`),
        at most 16 MiB."""
        from etils import epath

        from .._bytes import files as _files

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

    def __repr__(self) -> str:
        return "StateDictMapping()" + "".join(r.label() for r in self.rules)


def for_import(renamed: Mapping[str, str | None]) -> StateDictMapping:
    """The mapping that an `import --rename` map stands for, once applied to
    the tensors' names: `renamed` is `{tensor name: leaf name or None}`
    (`RenameMap.apply`), read the other way: a `rename` of each leaf to its
    tensor, and an `ignore` of the tensors renamed to None."""
    names = {
        escape(leaf): escape(tensor)
        for tensor, leaf in renamed.items()
        if leaf is not None and leaf != tensor
    }
    ignored = [escape(t) for t, leaf in renamed.items() if leaf is None]
    rules: list[Rule] = []
    if names:
        rules.append(Rename(tuple(names.items())))
    if ignored:
        rules.append(Ignore(tuple(ignored)))
    return StateDictMapping(tuple(rules))


def _parse_text(data: str | bytes) -> Any:
    if len(data) > MAX_JSON_BYTES:
        raise MappingError(
            f"The mapping is {len(data)} bytes long, more than the "
            f"{MAX_JSON_BYTES >> 20} MiB a mapping may have."
        )
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # also bytes that are not UTF-8
        raise MappingError(f"The mapping is not valid JSON ({e}).") from None


def _rules(data: Any) -> tuple[Rule, ...]:
    if not isinstance(data, list):
        raise MappingError('The mapping\'s "rules" must be a list of rules.')
    if len(data) > MAX_RULES:
        raise MappingError(
            f"The mapping has {len(data)} rules, more than the {MAX_RULES} allowed."
        )
    rules = []
    for i, item in enumerate(data):
        where = f"Rule {i}"
        if not isinstance(item, Mapping) or not isinstance(item.get("op"), str):
            raise MappingError(f'{where} must be a JSON object with an "op".')
        kind = RULES.get(item["op"])
        if kind is None:
            raise MappingError(
                f"{where} has the unknown op {item['op']!r}"[:200]
                + f"; the ops are {', '.join(RULES)}."
            )
        rules.append(kind.from_json(item, f"{where} ({item['op']})"))
    return tuple(rules)


def _names(value: Any, one: bool = True) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return list(value)
    return value  # refused by the rule's own check, with its message


def _ints(value: Any) -> Any:
    if value is None or isinstance(value, str) or not isinstance(value, Sequence):
        return value
    return [int(v) if isinstance(v, np.integer) else v for v in value]


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise MappingError(f"`cast` takes a dtype, not {dtype!r}.") from None
