"""The layouts `bridge_load.py` writes and loads: published Hugging Face names.

Each `Layout` says which tensors a set holds (`tensor_shapes`), which leaves
the scanned skeleton has and where each comes from (`whole`: one tensor;
`stacked`: one tensor per layer, perhaps a part of it, perhaps transposed),
and the `oeqx.StateDictMapping` between the two. The contenders read these
tables, so that `glue` and `orbax` do by hand what the mapping declares.

- `gpt2`: `GPT2LMHeadModel`'s names. `h.{i}.attn.c_attn.weight` is
  PyTorch's Conv1D, (in, 3 x out): transposed and split into q, k, v;
  `c_proj`, `c_fc` transposed; layer norms and biases stacked; `wte`, `wpe`.
- `llama`: `LlamaForCausalLM`'s names. `model.layers.{i}.self_attn.
  {q,k,v,o}_proj.weight` (dim, dim), `mlp.{gate,up}_proj.weight` (ffn, dim),
  `mlp.down_proj.weight` (dim, ffn), RMSNorm weights, `model.embed_tokens`,
  `model.norm` and an untied `lm_head`, with ffn = 4 x dim (GPT-2's MLP
  width) and as many key/value heads as query heads. `nn.Linear` holds
  (out, in) like `eqx.nn.Linear`: nothing is transposed or split, the
  mapping only renames and stacks.
"""

import dataclasses
from collections.abc import Callable

Shapes = dict[str, tuple[int, ...]]
# A stacked leaf: (leaf, tensor template, part of the tensor, transposed).
# `part` is (axis, j, parts): the j-th of `parts` equal blocks along `axis`.
Stacked = tuple[str, str, tuple[int, int, int] | None, bool]


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout: the tensors of a set, the skeleton's leaves, the mapping."""

    name: str
    tensors: Callable[[int, int, int], Shapes]  # (layers, dim, vocab) -> shapes
    whole: tuple[tuple[str, str], ...]  # (leaf, tensor), not stacked
    stacked: tuple[Stacked, ...]
    rules: Callable[[], object]  # makes the StateDictMapping

    def tensor_shapes(self, layers: int, dim: int, vocab: int) -> Shapes:
        return self.tensors(layers, dim, vocab)

    def leaf_shapes(self, layers: int, dim: int, vocab: int) -> Shapes:
        t = self.tensors(1, dim, vocab)
        out = {leaf: t[tensor] for leaf, tensor in self.whole}
        for leaf, template, part, transposed in self.stacked:
            shape = list(t[template.format(0)])
            if part is not None:
                shape[part[0]] //= part[2]
            if transposed:
                shape.reverse()
            out[leaf] = (layers, *shape)
        return out

    def mapping(self):
        """The mapping for this skeleton's leaf names (made once: importing
        orbax_eqx costs a second)."""
        if self.name not in _MAPPINGS:
            _MAPPINGS[self.name] = self.rules()
        return _MAPPINGS[self.name]


_MAPPINGS: dict = {}


# --------------------------------------------------------------- GPT-2


def _gpt2_tensors(layers: int, dim: int, vocab: int) -> Shapes:
    """The published GPT-2 names and shapes (vocabulary as given)."""
    out = {"wte.weight": (vocab, dim), "wpe.weight": (1024, dim)}
    for i in range(layers):
        h = f"h.{i}"
        out |= {
            f"{h}.ln_1.weight": (dim,),
            f"{h}.ln_1.bias": (dim,),
            f"{h}.attn.c_attn.weight": (dim, 3 * dim),
            f"{h}.attn.c_attn.bias": (3 * dim,),
            f"{h}.attn.c_proj.weight": (dim, dim),
            f"{h}.attn.c_proj.bias": (dim,),
            f"{h}.ln_2.weight": (dim,),
            f"{h}.ln_2.bias": (dim,),
            f"{h}.mlp.c_fc.weight": (dim, 4 * dim),
            f"{h}.mlp.c_fc.bias": (4 * dim,),
            f"{h}.mlp.c_proj.weight": (4 * dim, dim),
            f"{h}.mlp.c_proj.bias": (dim,),
        }
    out |= {"ln_f.weight": (dim,), "ln_f.bias": (dim,)}
    return out


def _gpt2_stacked() -> tuple[Stacked, ...]:
    out = [
        ("blocks.ln_1.weight", "h.{}.ln_1.weight", None, False),
        ("blocks.ln_1.bias", "h.{}.ln_1.bias", None, False),
        ("blocks.attn.proj.weight", "h.{}.attn.c_proj.weight", None, True),
        ("blocks.attn.proj.bias", "h.{}.attn.c_proj.bias", None, False),
        ("blocks.ln_2.weight", "h.{}.ln_2.weight", None, False),
        ("blocks.ln_2.bias", "h.{}.ln_2.bias", None, False),
        ("blocks.mlp.fc.weight", "h.{}.mlp.c_fc.weight", None, True),
        ("blocks.mlp.fc.bias", "h.{}.mlp.c_fc.bias", None, False),
        ("blocks.mlp.proj.weight", "h.{}.mlp.c_proj.weight", None, True),
        ("blocks.mlp.proj.bias", "h.{}.mlp.c_proj.bias", None, False),
    ]
    for j, x in enumerate("qkv"):
        out.append(
            (f"blocks.attn.{x}.weight", "h.{}.attn.c_attn.weight", (1, j, 3), True)
        )
        out.append((f"blocks.attn.{x}.bias", "h.{}.attn.c_attn.bias", (0, j, 3), False))
    return tuple(out)


def _gpt2_mapping():
    import orbax_eqx as oeqx

    return (
        oeqx.StateDictMapping()
        .rename(
            {
                "blocks.attn.proj": "blocks.attn.c_proj",
                "blocks.mlp.fc": "blocks.mlp.c_fc",
                "blocks.mlp.proj": "blocks.mlp.c_proj",
            }
        )
        .stack("blocks", "h.{i}")
        .fuse(
            [f"h.{{i}}.attn.{x}.weight" for x in "qkv"],
            "h.{i}.attn.c_attn.weight",
            axis=0,
        )
        .fuse(
            [f"h.{{i}}.attn.{x}.bias" for x in "qkv"],
            "h.{i}.attn.c_attn.bias",
            axis=0,
        )
        .transpose("h.{i}.*.c_*.weight")  # Conv1D holds (in, out)
    )


GPT2 = Layout(
    name="gpt2",
    tensors=_gpt2_tensors,
    whole=tuple(
        (n, n) for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
    ),
    stacked=_gpt2_stacked(),
    rules=_gpt2_mapping,
)


# --------------------------------------------------------------- LLaMA

# The skeleton's names (as `tests/bridge_models.py` names a scanned LLaMA,
# with q, k, v apart) -> the published ones, below `layers.` and `model.`.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}


def _llama_tensors(layers: int, dim: int, vocab: int) -> Shapes:
    """The published LLaMA names and shapes (`LlamaForCausalLM.state_dict()`,
    untied head), ffn = 4 x dim."""
    ffn = 4 * dim
    out = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(layers):
        m = f"model.layers.{i}"
        out |= {
            f"{m}.input_layernorm.weight": (dim,),
            f"{m}.self_attn.q_proj.weight": (dim, dim),
            f"{m}.self_attn.k_proj.weight": (dim, dim),
            f"{m}.self_attn.v_proj.weight": (dim, dim),
            f"{m}.self_attn.o_proj.weight": (dim, dim),
            f"{m}.post_attention_layernorm.weight": (dim,),
            f"{m}.mlp.gate_proj.weight": (ffn, dim),
            f"{m}.mlp.up_proj.weight": (ffn, dim),
            f"{m}.mlp.down_proj.weight": (dim, ffn),
        }
    out |= {"model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    return out


def _llama_mapping():
    import orbax_eqx as oeqx

    return (
        oeqx.StateDictMapping()
        .rename(
            {
                "embed": "model.embed_tokens",
                "norm": "model.norm",
                "head": "lm_head",
            }
            | {f"layers.{a}": f"layers.{b}" for a, b in _LLAMA_LAYER.items()}
        )
        .stack("layers", "model.layers.{i}")
    )


LLAMA = Layout(
    name="llama",
    tensors=_llama_tensors,
    whole=(
        ("embed.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("head.weight", "lm_head.weight"),
    ),
    stacked=tuple(
        (f"layers.{a}.weight", f"model.layers.{{}}.{b}.weight", None, False)
        for a, b in _LLAMA_LAYER.items()
    ),
    rules=_llama_mapping,
)

LAYOUTS = {layout.name: layout for layout in (GPT2, LLAMA)}
