"""Decoding a 50,000-leaf sidecar: the standard library alone, ours (the
schemas of `_format/schema.py` and every check), and the schema libraries
that were weighed for it, msgspec (chosen) and attrs + cattrs.

Saves one checkpoint of `--leaves` leaves (small numpy arrays, with some
Python scalars among them) with orbax_eqx, then decodes its sidecar's bytes
`--repeats` times with each contender, in this process, and prints the median
time and the peak of Python's allocations (tracemalloc) of each, beside the
standard library's as ratios:

- `json.loads alone`: the standard library's decoding, no checks;
- `ours`: `_format/sidecar_read` as a restore reads the bytes (the checksum
  line aside): msgspec decodes the document in one pass by the format's
  schema, then the checks no schema says alone (checksums per version,
  where the bytes are, across records) make the `Metadata`;
- `ours, stdlib path`: the same schemas and checks over `json.loads`'s
  output (what reads a sidecar msgspec does not decode: lone surrogates);
- `msgspec schema alone`, `attrs + cattrs schema alone`: each library's
  decoding into classes with the same allow lists (types, literals,
  bounds), no check across fields: how the two libraries compare.

Timings taken while other work shares the cores are noisy: compare the
ratios of one run.

    python benchmarks/sidecar_schema.py --leaves 50000 --repeats 5
"""

import argparse
import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Annotated, Any, Literal

import attrs
import cattrs
import msgspec
import numpy as np

import orbax_eqx as oeqx
from orbax_eqx._format.sidecar import FILE_NAME
from orbax_eqx._format.sidecar_read import _decode, parse

Size = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Name = Annotated[str, msgspec.Meta(max_length=4096)]
Kind = Literal["array", "scalar", "callable", "object", "shared"]
Data = Literal["packed", "shards", "orbax", "alias", "none"]


class Leaf(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    path: Name
    kind: Kind
    shape: list[Size] | None = None
    dtype: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    container: Literal["jax", "numpy", "numpy scalar"] | None = None
    nbytes: Size = 0
    data: Data | None = None
    pack: Size | None = None
    offset: Size | None = None
    crc32: Annotated[int, msgspec.Meta(ge=0, lt=2**32)] | None = None
    sum32: Annotated[int, msgspec.Meta(ge=0, lt=2**32)] | None = None
    xxh3: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")] | None = None
    alias_of: Name | None = None
    key: Name | None = None
    sharding: str | None = None
    value: Any = None


class Pack(msgspec.Struct, forbid_unknown_fields=True):
    file: Name
    nbytes: Size
    byteorder: Literal["little", "big"]
    alignment: Annotated[int, msgspec.Meta(ge=1, le=2**20)]


class Module(msgspec.Struct, forbid_unknown_fields=True):
    path: Name
    static: dict[str, Any]
    # `class` is a Python keyword: renamed on the way in.
    cls: Name = msgspec.field(name="class")


class Sidecar(msgspec.Struct):
    format: Literal["orbax_eqx"]
    format_version: Annotated[int, msgspec.Meta(ge=1, le=6)]
    versions: dict[str, str]
    leaves: dict[Name, Leaf]
    modules: dict[Name, Module]
    packs: list[Pack] = []
    token: str | None = None
    shard_files: Size = 0
    nodes: dict[str, Any] | None = None
    checksums: bool = True
    checksum: str | None = None


def _size(instance, attribute, value):
    if value is not None and not (type(value) is int and 0 <= value <= 2**62):
        raise ValueError(f"{attribute.name} is no size: {value!r}")


def _u32(instance, attribute, value):
    if value is not None and not (type(value) is int and 0 <= value < 2**32):
        raise ValueError(f"{attribute.name} is no 32-bit checksum: {value!r}")


def _name(instance, attribute, value):
    if value is not None and not (type(value) is str and len(value) <= 4096):
        raise ValueError(f"{attribute.name} is no name: {value!r}")


def _hex64(instance, attribute, value):
    if value is not None and not (
        type(value) is str
        and len(value) == 16
        and set(value) <= set("0123456789abcdef")
    ):
        raise ValueError(f"{attribute.name} is no XXH3-64: {value!r}")


def _shape(instance, attribute, value):
    if value is not None:
        for d in value:
            _size(instance, attribute, d)


_in = attrs.validators.in_
_opt = attrs.validators.optional


@attrs.frozen
class ALeaf:
    path: str = attrs.field(validator=_name)
    kind: str = attrs.field(validator=_in(Kind.__args__))
    shape: list[int] | None = attrs.field(default=None, validator=_shape)
    dtype: str | None = attrs.field(default=None, validator=_name)
    container: str | None = attrs.field(
        default=None, validator=_opt(_in(("jax", "numpy", "numpy scalar")))
    )
    nbytes: int = attrs.field(default=0, validator=_size)
    data: str | None = attrs.field(default=None, validator=_opt(_in(Data.__args__)))
    pack: int | None = attrs.field(default=None, validator=_size)
    offset: int | None = attrs.field(default=None, validator=_size)
    crc32: int | None = attrs.field(default=None, validator=_u32)
    sum32: int | None = attrs.field(default=None, validator=_u32)
    xxh3: str | None = attrs.field(default=None, validator=_hex64)
    alias_of: str | None = attrs.field(default=None, validator=_name)
    key: str | None = attrs.field(default=None, validator=_name)
    sharding: str | None = attrs.field(default=None)
    value: Any = None


@attrs.frozen
class APack:
    file: str = attrs.field(validator=_name)
    nbytes: int = attrs.field(validator=_size)
    byteorder: str = attrs.field(validator=_in(("little", "big")))
    alignment: int = attrs.field(validator=_size)


@attrs.frozen
class AModule:
    path: str = attrs.field(validator=_name)
    static: dict[str, Any]
    cls: str = attrs.field(validator=_name)


@attrs.frozen
class ASidecar:
    format: str = attrs.field(validator=_in(("orbax_eqx",)))
    format_version: int = attrs.field(validator=_in(range(1, 7)))
    versions: dict[str, str]
    leaves: dict[str, ALeaf]
    modules: dict[str, AModule]
    packs: list[APack] = attrs.Factory(list)
    token: str | None = None
    shard_files: int = attrs.field(default=0, validator=_size)
    nodes: dict[str, Any] | None = None
    checksums: bool = True
    checksum: str | None = None


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(Any, lambda v, _: v)
    converter.register_structure_hook(
        AModule,
        lambda d, _: AModule(path=d["path"], static=d["static"], cls=d["class"]),
    )
    return converter


def _model(n: int) -> dict:
    rng = np.random.default_rng(0)
    tree: dict[str, Any] = {}
    for i in range(n):
        if i % 10 == 9:
            tree[f"scalar_{i}"] = float(i)
        else:
            tree[f"w_{i}"] = rng.standard_normal(4).astype(np.float32)
    return tree


def _measure(decode, raw: bytes, repeats: int) -> tuple[float, int]:
    decode(raw)  # warm-up (and a check that it accepts the sidecar)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode(raw)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    decode(raw)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        oeqx.save(Path(tmp) / "ckpt", _model(args.leaves))
        raw = (Path(tmp) / "ckpt" / FILE_NAME).read_bytes()
    # The checksum line is checked before the JSON is read (`sealed`): the
    # same for every contender, so it is left out here.
    text = raw.decode()
    converter = _converter()
    decoder = msgspec.json.Decoder(Sidecar)
    where = Path("bench")
    contenders = {
        "json.loads alone": json.loads,
        "ours": lambda b: _decode(b, where / FILE_NAME, True, "bench"),
        "ours, stdlib path": lambda b: parse(json.loads(b), "bench"),
        "msgspec schema alone": decoder.decode,
        "attrs + cattrs schema alone": lambda b: converter.structure(
            json.loads(b), ASidecar
        ),
    }
    print(
        f"{args.leaves} leaves, sidecar {len(text) / 2**20:.1f} MiB, median of "
        f"{args.repeats}; peak = Python allocations (tracemalloc) during one decode"
    )
    base = None
    for name, decode in contenders.items():
        seconds, peak = _measure(decode, raw, args.repeats)
        base = base or (seconds, peak)
        print(
            f"{name:28s} {seconds * 1000:8.1f} ms ({seconds / base[0]:.2f}x)  "
            f"peak {peak / 2**20:7.1f} MiB ({peak / base[1]:.2f}x)"
        )


if __name__ == "__main__":
    main()
