"""The published format: the JSON Schema in docs/format.schema.json is the one
generated from the structures that decode the files, it validates what saves
write, and the format page names every field it has.

Reaches inside: the committed schema must be what `_format.schema` generates.

Regenerate it with
`python -c "import json; from orbax_eqx._format.schema import json_schema;
print(json.dumps(json_schema(), indent=1, sort_keys=True))" >
docs/format.schema.json`.
"""

import json
import pathlib
import re

import jax
import jsonschema
import pytest
import sharded_saves
import zoo

import orbax_eqx as oeqx
from orbax_eqx._format.schema import json_schema

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "docs" / "format.schema.json"
PAGE = ROOT / "docs" / "guides" / "format.md"


def test_the_published_schema_is_the_generated_one():
    assert json.loads(SCHEMA.read_text()) == json_schema(), (
        "docs/format.schema.json is stale: regenerate it (see this module's docstring)."
    )


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_the_schema_validates_every_saved_sidecar(tmp_path, make):
    oeqx.save(tmp_path / "ckpt", make(jax.random.key(0)))
    sidecar = json.loads((tmp_path / "ckpt" / "orbax_eqx.json").read_text())
    jsonschema.validate(sidecar, json.loads(SCHEMA.read_text()))


def test_the_schema_validates_a_sidecar_of_orbax_stored_arrays(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.mlp(jax.random.key(0)), pack=False)
    sidecar = json.loads((tmp_path / "ckpt" / "orbax_eqx.json").read_text())
    jsonschema.validate(sidecar, json.loads(SCHEMA.read_text()))


@pytest.mark.slow
def test_the_schema_validates_shard_indexes(tmp_path):
    paths = sharded_saves.save_all(tmp_path)
    schema = json.loads(SCHEMA.read_text())
    for path in paths.values():
        for _, index in sharded_saves.shard_files(path).values():
            jsonschema.validate(json.loads(index.read_text()), schema)


def test_the_schema_refuses_what_no_save_writes(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.mlp(jax.random.key(0)))
    sidecar = json.loads((tmp_path / "ckpt" / "orbax_eqx.json").read_text())
    schema = json.loads(SCHEMA.read_text())
    for edit in (
        lambda c: c.update(format_version=6),
        lambda c: c.update(token="XYZ"),
        lambda c: c["leaves"].update(w={"kind": "pickle"}),
    ):
        edited = json.loads(json.dumps(sidecar))
        edit(edited)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(edited, schema)


def test_the_format_page_names_every_field_of_the_schema():
    page = PAGE.read_text()
    named = set(re.findall(r"`([a-z_0-9]+)`", page))
    named |= set(re.findall(r'"([a-z_0-9]+)"', page))
    fields = set()
    for definition in json_schema()["$defs"].values():
        fields |= set(definition.get("properties", {}))
    missing = sorted(fields - named)
    assert not missing, f"docs/guides/format.md does not name the fields {missing}"
