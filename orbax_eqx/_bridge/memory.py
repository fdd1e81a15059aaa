"""`to_state_dict` and `from_state_dict`: the bridge in memory, planned first,
then following the plan's pieces."""

from collections.abc import Mapping
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._errors import bullet_list
from .._mapping.errors import BridgeError
from .._mapping.mapping import StateDictMapping
from .._mapping.pieces import IDENTITY, Box, shape, slices, to_leaf, to_tensor
from .._mapping.plan import Plan, TensorSpec, leaf_specs, plan_export, plan_load
from .._restore.shardings import resolve
from .._storage.engine import Refused, values_refused
from .._tree.walk import (
    ARRAY,
    JAX,
    NUMPY_SCALAR,
    Walked,
    container,
    is_key_dtype,
    key_impl,
    walk,
)


def to_state_dict(
    tree: Any, mapping: StateDictMapping | None = None
) -> dict[str, np.ndarray]:
    """The array leaves of `tree` as a flat dict of numpy arrays, named and
    shaped as another layout's tensors (a PyTorch `state_dict`).

    **Arguments:**

    - `tree`: a model, or any PyTree holding arrays (jax or numpy). Every
        array must be on this process (for a model sharded across hosts, use
        `oeqx.export_safetensors`).
    - `mapping`: how leaves become tensors (`oeqx.StateDictMapping`, or its
        JSON data); `None` names each tensor by its leaf name
        (`layers.0.weight`).

    **Returns:**

    `{tensor name: numpy array}`, in natural order of the names (`h.2` before
    `h.10`). Typed PRNG keys become their key data (uint32). Non-array leaves
    (activation functions, Python numbers, static fields) are not tensors;
    keep the model's code or an orbax_eqx checkpoint for them.

    Raises `oeqx.BridgeError` listing every problem at once (rules that
    match nothing, names two leaves would share, shapes a rule cannot take).

    !!! example

        ```python
        tensors = oeqx.to_state_dict(model, mapping)
        safetensors.numpy.save_file(tensors, "model.safetensors")
        ```
    """
    walked = walk(tree)
    mapping = _mapping(mapping).resolve(tree)
    _check_concrete(walked)
    specs = leaf_specs(walked)
    plan = plan_export(mapping, specs)
    wanted = [leaf for leaf in walked.leaves if leaf.name in plan.leaves]
    host = dict(zip((leaf.name for leaf in wanted), _to_host(wanted), strict=True))
    return _tensors(plan, host)


def _tensors(plan: Plan, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each tensor of `plan`; a layer of a stack is a view of one copy of its leaf."""
    result = {}
    dtypes: dict[str, np.dtype] = {}
    wholes: dict[tuple[int, ...], Box] = {}
    copies: dict[tuple[str, np.dtype], np.ndarray] = {}  # ours, not the caller's
    for name, spec in plan.tensors.items():
        dtype = dtypes.get(spec.dtype)
        if dtype is None:
            dtype = dtypes[spec.dtype] = np.dtype(spec.dtype)
        whole = wholes.get(spec.shape)
        if whole is None:
            whole = wholes[spec.shape] = tuple((0, n) for n in spec.shape)
        p = plan.piece(name)
        if p is not None and p.tensor_box == whole:
            part = _from_one_leaf(p, spec.shape, dtype, host, copies)
            if name in plan.ties or not part.flags.c_contiguous:
                part = np.array(part, order="C")  # (a tied copy: its own)
            result[name] = part
            continue
        out = np.empty(spec.shape, dtype)
        for p in plan.tensor_pieces(name):
            out[slices(p.tensor_box)] = to_tensor(p, host[p.leaf][slices(p.leaf_box)])
        result[name] = out
    return result


def _from_one_leaf(p, shape, dtype, host, copies) -> np.ndarray:
    """A tensor that is one box of one leaf: a view of the leaf's copy in
    `dtype` where it can be."""
    copy = copies.get((p.leaf, dtype))
    if copy is None:
        copy = copies[p.leaf, dtype] = np.array(host[p.leaf], dtype)
    box = p.leaf_box
    if (
        len(box) == len(shape) + 1
        and box[1:] == tuple((0, n) for n in shape)
        and copy.shape[1:] == shape
        and box[0][1] - box[0][0] == 1
        and p.perm == IDENTITY[len(p.perm)]
    ):
        return copy[box[0][0], ...]  # a layer of a stack, as it is
    return to_tensor(p, copy[slices(box)])


def from_state_dict(
    skeleton: Any,
    tensors: Mapping[str, Any],
    mapping: StateDictMapping | None = None,
    *,
    cast: bool = False,
    shardings: Any = None,
    allow_unused: bool = False,
) -> Any:
    """A model filled with the tensors of another layout (a PyTorch
    `state_dict`, converted to numpy), through a mapping.

    **Arguments:**

    - `skeleton`: the model's structure, as for `oeqx.restore`: usually
        `eqx.filter_eval_shape(make_model, key)`, which allocates nothing. It
        gives the structure, classes, static fields, callables and non-array
        leaves; every array leaf is filled from the tensors, except those the
        mapping drops, which keep the skeleton's values.
    - `tensors`: `{name: array}`, numpy or jax arrays (a PyTorch state_dict
        as `{k: v.numpy() for k, v in state_dict.items()}`; `bfloat16` tensors
        as `v.float().numpy()`, or read with `safetensors.numpy`).
    - `mapping`: how leaves become tensors (`oeqx.StateDictMapping`, or its
        JSON data), read the other way; `None` for tensors named as the leaves.
    - `cast`: cast tensors whose dtype differs from what the mapping expects
        to the skeleton's dtypes (else each such tensor is an error).
    - `shardings`: where the arrays go, as for `oeqx.restore`: one
        `jax.sharding.Sharding`, a PyTree of them shaped like the skeleton, or
        a function `(leaf name, leaf) -> Sharding`; by default the skeleton
        leaf's own sharding, else one local device.
    - `allow_unused`: leave alone tensors no leaf maps to (else each is an
        error, unless an `ignore` rule of the mapping matches it).

    **Returns:**

    The skeleton with its arrays filled: jax arrays where the skeleton has
    jax arrays or `jax.ShapeDtypeStruct`s, numpy where it has numpy. Typed
    PRNG keys are read from their key data.

    Raises `oeqx.BridgeError` before any value is read, listing every
    problem at once, each naming the tensor and the leaf: missing tensors (a
    missing layer as one), tensors no leaf maps to, shapes, dtypes, rules
    that match nothing.

    !!! example

        ```python
        skeleton = eqx.filter_eval_shape(GPT2, config, key=jax.random.key(0))
        model = oeqx.from_state_dict(skeleton, tensors, mapping)
        ```
    """
    walked = walk(skeleton)
    mapping = _mapping(mapping).resolve(skeleton)
    given = _tensor_specs(tensors)
    plan = plan_load(
        mapping, leaf_specs(walked), given, cast=cast, allow_unused=allow_unused
    )
    _check_kept(walked, plan)
    _check_ties(plan, tensors)
    targets = resolve(shardings, walked)
    host: dict[str, np.ndarray] = {}
    refused: dict[tuple[str, str, np.dtype], list[Refused]] = {}

    def tensor(name: str) -> np.ndarray:
        if name not in host:
            host[name] = np.asarray(tensors[name])
        return host[name]

    values = []
    for leaf in walked.leaves:
        if leaf.kind != ARRAY:
            values.append(leaf.value)  # the skeleton's own
        elif leaf.name in plan.dropped:
            values.append(_kept(leaf.value, targets.get(leaf.name)))
        else:
            sharding = targets.get(leaf.name)
            values.append(_build(plan, leaf, tensor, sharding, refused))
    check_values(refused)
    return jtu.tree_unflatten(walked.treedef, values)


FIX_CAST_VALUES = (
    "A cast of such values has no defined result: clean them first "
    "(`np.nan_to_num`, `np.clip` to the range), or give those leaves a float "
    "dtype in the skeleton (or a wider integer one)."
)
FIX_BOOLS = (
    "A bool is one byte, 0 or 1; any other reads as True on some devices and "
    "False on others. Such a tensor is damaged, or was not written as bool (a "
    "view of another dtype's bytes): write it again from its source, or make it "
    "bools with `x.view(np.uint8) != 0`."
)


def check_values(
    found: dict[tuple[str, str, Any], list[Refused]],
    stored: str = "",
    errors: tuple[type[BridgeError], type[BridgeError]] = (BridgeError, BridgeError),
) -> None:
    """Raises for values a load did not place (`{(tensor, leaf label, dtype
    cast to): what}`; `stored`: where the tensors are, after "tensors"):
    bytes that are no bools first (`errors[0]`), then values a cast cannot
    keep (`errors[1]`)."""
    said = {key: Refused.total(what) for key, what in found.items()}
    bools = [key for key, what in said.items() if what.bools]
    keys, error = (bools, errors[0]) if bools else (list(said), errors[1])
    if not keys:
        return
    lines = [
        f"Tensor `{key[0]}` (leaf {key[1]}) holds {said[key].said(key[2])}."
        for key in keys
    ]
    head, fix = (
        (f"bool tensors{stored} hold bytes other than 0 and 1", FIX_BOOLS)
        if bools
        else (
            f"tensors{stored} hold values a cast to the skeleton's dtypes cannot keep",
            FIX_CAST_VALUES,
        )
    )
    _refuse(f"Some {head}", lines, fix, error)


def _refuse(head: str, problems: list[str], fix: str, error=BridgeError) -> None:
    if problems:
        raise error(f"{head}:\n{bullet_list(problems)}\n{fix}")


def _mapping(mapping: Any) -> StateDictMapping:
    if mapping is None:
        return StateDictMapping()
    if isinstance(mapping, StateDictMapping):
        return mapping
    return StateDictMapping.from_json(mapping)


def _tensor_specs(tensors: Any) -> list[TensorSpec]:
    if not isinstance(tensors, Mapping):
        raise BridgeError(
            f"`tensors` is a {type(tensors).__name__}: pass a dict "
            "{name: numpy or jax array}."
        )
    specs, problems, fixes = [], [], []
    for name, x in tensors.items():
        if not isinstance(name, str):
            problems.append(f"The key {name!r} is {type(name).__name__}, not a name.")
            fixes.append(_FIX_NOT_ARRAYS)
            continue
        refused = _refused(x)
        if refused is not None:
            what, fix = refused
            problems.append(f"Tensor `{name}` {what}.")
            fixes.append(fix)
            continue
        dtype = getattr(x, "dtype", None)
        try:
            dtype = np.dtype(dtype) if dtype is not None else None
        except TypeError:
            dtype = None
        # (`__array__`: a `jax.ShapeDtypeStruct` has a shape and a dtype, no values)
        if dtype is None or not hasattr(x, "shape") or not hasattr(x, "__array__"):
            problems.append(
                f"Tensor `{name}` is a {type(x).__name__}, not a numpy or jax array."
            )
            fixes.append(_FIX_NOT_ARRAYS)
            continue
        specs.append(TensorSpec(name, tuple(int(n) for n in x.shape), str(dtype)))
    fix = "\n".join(dict.fromkeys(fixes))
    _refuse("Some tensors are not named arrays", problems, fix)
    return specs


_FIX_NOT_ARRAYS = (
    "Pass a dict {name: numpy or jax array}; a PyTorch state_dict as "
    "`{k: v.numpy() for k, v in state_dict.items()}` (bfloat16 tensors as "
    "`v.float().numpy()`)."
)
_FIX_TORCH = (
    "Call `.numpy()` on each PyTorch tensor first (`v.detach().cpu().numpy()` for "
    "one that needs gradients or sits on a GPU, `v.float().numpy()` for bfloat16, "
    "which numpy lacks; `cast=True` then casts to the skeleton's dtype), or read "
    "the file with `safetensors.numpy`."
)
_FIX_SUBCLASS = (
    "Pass a plain array of the values you mean: `np.ma.getdata(x)` (or "
    "`x.filled(value)`) for a masked array, `np.asarray(x)` for other subclasses."
)


def _refused(x: Any) -> tuple[str, str] | None:
    """`(what it is, the fix)` for a PyTorch tensor (told by its type's module)
    or a subclass of `np.ndarray` whose additions a load would drop."""
    kind = type(x)
    module = getattr(kind, "__module__", "") or ""
    if module == "torch" or module.startswith("torch."):
        return f"is a PyTorch tensor ({module}.{kind.__qualname__})", _FIX_TORCH
    if isinstance(x, np.ndarray) and kind is not np.ndarray and kind is not np.memmap:
        return (
            f"is a {kind.__module__}.{kind.__qualname__}, a subclass of numpy.ndarray: "
            "a load would take its data and drop what the subclass adds (a mask)",
            _FIX_SUBCLASS,
        )
    return None


def _check_concrete(walked: Walked) -> None:
    problems = []
    for leaf in walked.leaves:
        if leaf.kind != ARRAY:
            continue
        x = leaf.value
        if isinstance(x, jax.ShapeDtypeStruct):
            problems.append(
                f"Leaf {leaf.label} is a jax.ShapeDtypeStruct, which holds no values."
            )
        elif isinstance(x, jax.Array) and not x.is_fully_addressable:
            problems.append(
                f"Leaf {leaf.label} is sharded across processes: this process holds "
                "only part of it."
            )
    _refuse(
        "`to_state_dict` needs every array's values on this process",
        problems,
        "Pass the model itself, not a skeleton; for a model sharded across "
        "hosts, export it with `oeqx.export_safetensors`.",
    )


def _to_host(leaves) -> list[np.ndarray]:
    """The leaves' values on host (key data for typed keys), in one transfer."""
    values = []
    for leaf in leaves:
        x = leaf.value
        if is_key_dtype(x.dtype):
            x = jax.random.key_data(x)
        values.append(x)
    return [np.asarray(x) for x in jax.device_get(values)]


def _check_kept(walked: Walked, plan: Plan) -> None:
    problems = [
        f"Leaf {leaf.label} is dropped by the mapping, and the skeleton holds a "
        "jax.ShapeDtypeStruct there, which has no value to keep."
        for leaf in walked.leaves
        if leaf.name in plan.dropped and isinstance(leaf.value, jax.ShapeDtypeStruct)
    ]
    _refuse(
        "Some leaves get no values",
        problems,
        "A leaf the mapping drops keeps the skeleton's value: build those "
        "parts of the skeleton as arrays (with a real key, not "
        "`eqx.filter_eval_shape`), or map a tensor to them.",
    )


def _check_ties(plan: Plan, tensors: Mapping[str, Any]) -> None:
    problems = []
    for copy, source in plan.ties.items():
        a, b = np.asarray(tensors[copy]), np.asarray(tensors[source])
        if a.shape != b.shape or a.astype(b.dtype).tobytes() != b.tobytes():
            problems.append(
                f"Tensor `{copy}` is tied to `{source}` by the mapping, but holds "
                "other values."
            )
    _refuse(
        "Tied tensors differ",
        problems,
        "These tensors come from a model whose output head is its own: "
        "load them into a model with an untied head (a leaf mapped to the "
        "tensor), or remove the `tie` rule and `ignore` the tensor to drop it.",
    )


def _build(plan: Plan, leaf, tensor, sharding, refused: dict) -> Any:
    """The leaf's array; what of its tensors cannot be placed goes to `refused`
    (see `check_values`)."""
    spec = plan.leaves[leaf.name]
    x = leaf.value
    kind = container(x)
    key = is_key_dtype(x.dtype)
    dtype = np.dtype(spec.dtype)

    def fill(box: Box) -> np.ndarray:
        out = np.empty(shape(box), dtype)
        for p in plan.leaf_pieces(leaf.name, box):
            src = tensor(p.tensor)[slices(p.tensor_box)]
            at = tuple(
                slice(a - start, b - start)
                for (a, b), (start, _) in zip(p.leaf_box, box, strict=True)
            )
            found = values_refused(src, dtype)
            if found is not None:
                refused.setdefault((p.tensor, leaf.label, dtype), []).append(found)
                continue
            out[at] = to_leaf(p, src)
        return out

    full = tuple((0, n) for n in spec.shape)
    if kind != JAX:
        value = fill(full)
        return value[()] if kind == NUMPY_SCALAR else value
    if key:
        data = jax.device_put(fill(full), sharding)
        return jax.random.wrap_key_data(data, impl=key_impl(x.dtype))
    done: dict[Box, np.ndarray] = {}  # replicas ask for the same box

    def callback(index) -> np.ndarray:
        box = tuple(
            (s.start or 0, spec.shape[a] if s.stop is None else s.stop)
            for a, s in enumerate(index)
        )
        if box not in done:
            done[box] = fill(box)
        return done[box]

    return jax.make_array_from_callback(spec.shape, sharding, callback)


def _kept(x: Any, sharding) -> Any:
    if isinstance(x, jax.Array) and sharding is not None:
        if not x.sharding.is_equivalent_to(sharding, x.ndim):
            return jax.device_put(x, sharding)
    return x
