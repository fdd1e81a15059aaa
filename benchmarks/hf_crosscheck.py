"""Whether the state_dict bridge agrees with PyTorch `transformers`: keys and logits.

The tests check the bridge's GPT-2 and LLaMA layouts against the published
tensor names and shapes and a numpy reference of each architecture, without
PyTorch (its wheels are too big for CI). This script closes the loop where
`torch` and `transformers` are installed (the GPU machine's image has both):

1. an Equinox model (tests/bridge_models.py), exported with
   `oeqx.export_safetensors(model, dir, mapping=...)`, is loaded by
   `transformers`' `from_pretrained` with no missing or unexpected keys, and
   its logits match the Equinox model's;
2. a `transformers` model, saved with `save_pretrained`, is loaded with
   `oeqx.load_safetensors(dir, skeleton, mapping=...)`, and the Equinox
   model's logits match the `transformers` model's.

    python benchmarks/hf_crosscheck.py        # exit 0 when all four agree

Runs on CPU (torch and jax both); float32, a tolerance of 1e-4.
"""

import pathlib
import sys
import tempfile

import jax

jax.config.update("jax_platforms", "cpu")

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import bridge_models as bm  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

IDS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], np.int32)
TOL = 1e-4
# One file, then a set of files with model.safetensors.index.json (bytes).
SHARDS = (0, 8192)


def gpt2_config(c: bm.GPT2Config):
    return transformers.GPT2Config(
        vocab_size=c.vocab,
        n_positions=c.positions,
        n_embd=c.width,
        n_layer=c.layers,
        n_head=c.heads,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )


def llama_config(c: bm.LlamaConfig):
    return transformers.LlamaConfig(
        vocab_size=c.vocab,
        hidden_size=c.width,
        intermediate_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads,
        rope_theta=c.theta,
        rms_norm_eps=c.eps,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


def torch_logits(model) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(IDS[None], dtype=torch.long))
    return out.logits[0].float().numpy()


def compare(what: str, ours, theirs) -> bool:
    err = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
    ok = np.asarray(ours).shape == np.asarray(theirs).shape and err <= TOL
    print(f"  [{'PASS' if ok else 'FAIL'}] {what}: max |difference| {err:.2e}")
    return ok


def keys_report(what: str, info: dict) -> bool:
    missing = [k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
    unexpected = list(info.get("unexpected_keys", []))
    mismatched = list(info.get("mismatched_keys", []))
    ok = not (missing or unexpected or mismatched)
    print(
        f"  [{'PASS' if ok else 'FAIL'}] {what}: missing {missing}, "
        f"unexpected {unexpected}, mismatched {mismatched}"
    )
    return ok


def export_then_from_pretrained(tmp, name, model, mapping, config, cls, shard) -> bool:
    out = pathlib.Path(tmp, f"{name}-export-{shard}")
    if shard:  # several files and model.safetensors.index.json
        exported = oeqx.export_safetensors(
            model, out, mapping=mapping, max_shard_size=shard
        )
    else:
        exported = oeqx.export_safetensors(model, out, mapping=mapping)
    config.save_pretrained(out)
    files = sorted(p.name for p in out.iterdir())
    print(
        f"{name}: exported {exported.tensors} tensors, {len(files)} files: {files[-1]}"
    )
    loaded, info = cls.from_pretrained(out, output_loading_info=True)
    ok = keys_report(f"{name}: {cls.__name__}.from_pretrained keys", info)
    return (
        compare(
            f"{name}: torch logits of the export / Equinox logits",
            torch_logits(loaded),
            model(IDS),
        )
        and ok
    )


def save_pretrained_then_load(tmp, name, skeleton, mapping, config, cls, shard) -> bool:
    torch.manual_seed(0)
    theirs = cls(config)
    # Non-trivial norms, so a swapped or dropped norm weight shows.
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "norm" in n or "ln_" in n:
                p.add_(0.1 * torch.randn_like(p))
    out = pathlib.Path(tmp, f"{name}-hf-{shard}")
    if shard:
        theirs.save_pretrained(out, max_shard_size=shard)
    else:
        theirs.save_pretrained(out)
    files = sorted(p.name for p in out.iterdir())
    print(
        f"{name}: {cls.__name__}.save_pretrained wrote {len(files)} files: {files[-1]}"
    )
    ours = oeqx.load_safetensors(out, skeleton, mapping=mapping)
    return compare(
        f"{name}: Equinox logits after load_safetensors / torch logits",
        ours(IDS),
        torch_logits(theirs),
    )


def main() -> int:
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"jax {jax.__version__}, equinox {eqx.__version__}, backend "
        f"{jax.default_backend()}"
    )
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for shard in SHARDS:
            c = bm.GPT2Config()
            model = bm.GPT2(c, key=jax.random.key(3))
            skeleton = eqx.filter_eval_shape(bm.GPT2, c, key=jax.random.key(5))
            # GPT2Model's names (no `transformer.` prefix), as the published
            # checkpoints hold them; GPT2LMHeadModel ties its head to wte.
            hf = gpt2_config(c)
            ok &= export_then_from_pretrained(
                tmp,
                "gpt2",
                model,
                bm.GPT2_MAPPING,
                hf,
                transformers.GPT2LMHeadModel,
                shard,
            )
            ok &= save_pretrained_then_load(
                tmp, "gpt2", skeleton, bm.GPT2_MAPPING, hf, Gpt2Published, shard
            )
            c = bm.LlamaConfig()
            model = bm.Llama(c, key=jax.random.key(3))
            skeleton = eqx.filter_eval_shape(bm.Llama, c, key=jax.random.key(5))
            hf, cls = llama_config(c), transformers.LlamaForCausalLM
            ok &= export_then_from_pretrained(
                tmp, "llama", model, bm.LLAMA_MAPPING, hf, cls, shard
            )
            ok &= save_pretrained_then_load(
                tmp, "llama", skeleton, bm.LLAMA_MAPPING, hf, cls, shard
            )
    print("all agree" if ok else "SOME DIFFER")
    return 0 if ok else 1


class Gpt2Published(transformers.GPT2Model):
    """`GPT2Model` saves the names the published GPT-2 checkpoints hold
    (`h.0.attn.c_attn.weight`, no `transformer.` prefix); its logits are the
    last hidden state times the tied `wte`."""

    def forward(self, input_ids, **kwargs):
        hidden = super().forward(input_ids, **kwargs).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutput(
            logits=hidden @ self.wte.weight.T
        )


if __name__ == "__main__":
    sys.exit(main())
