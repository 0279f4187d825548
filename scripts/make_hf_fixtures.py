"""Make the HuggingFace oracle fixtures under tests/fixtures/hf with transformers itself.

    make install-oldest   # .venv-oldest: Python 3.11 with torch 2.13.0 (CPU) and transformers
    .venv-oldest/bin/python scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--gap_only]

Each fixture is a tiny seeded model saved by `save_pretrained` (config.json and safetensors)
with transformers' float32 logits and loss on fixed tokens (`oracle.npz`, `oracle.json`).
Every parameter is redrawn from the seed, norm gains and biases included: HF's default
initialisation (gains 1, biases 0) would let a converter that drops them pass. A mixture
of experts also stores, per layer, transformers' load-balancing loss of that layer alone on
row 0 (`router_aux`) and, in oracle.json, the smallest gap between a token's k-th and
(k+1)-th router logit over every layer of both oracles (`router_margin`: a near tie could
pick other experts under float32 rounding).

oracle.json also holds transformers' own float32 noise: `float64_gap` (max |logit_f32 -
logit_f64| over oracle.npz's logits) and `float64_gap_packed` (over oracle_packed.npz's), the
bound seqpipe's float32 error is held to a small multiple of (tests/test_hf.py). The float64
logits are the same model in float64 throughout (`float64_oracle`): transformers' float64
path alone (`.double()`) keeps RoPE's inverse frequencies and cos/sin tables, each RMSNorm,
the attention softmax and the router softmax in float32, so those are computed in float64
here, the inverse frequencies recomputed in float64 by transformers' own rope function
(`inv_freq64`).
`--gap_only` adds the two gaps to existing fixtures, leaving every other file as it was.

seqpipe's tests read these files without torch (tests/test_hf.py); the tests marked
`transformers` (make test-oracles) also rebuild the oracle live with `oracle` below.
"""

import argparse
import contextlib
import copy
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

SEED = 34
BATCH, LENGTH = 2, 40  # the token window is [BATCH, LENGTH + 1]
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    max_position_embeddings=64,
)

# name: (config class, config keys beyond TINY, save_pretrained options)
MODELS = {
    # GQA (4 query heads share 2 K/V heads) and llama3 rope scaling, whose original
    # context (16) is shorter than the tokens, so that dropping the scaling shows; sharded;
    # four layers, for the pipeline schedules on two and four stages.
    "llama_gqa_llama3": (
        "LlamaConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        dict(max_shard_size="80KB"),
    ),
    # Plain multi-head attention and one matrix for the embedding and the head.
    "llama_tied_mha": (
        "LlamaConfig",
        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
        {},
    ),
    # Qwen 2: biases on the Q, K and V projections, theta 1e6, eps 1e-6.
    "qwen2_bias": (
        "Qwen2Config",
        dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0),
        {},
    ),
    # Mistral: Llama's layout under its own name, without a sliding window (as v0.3).
    "mistral_gqa": (
        "MistralConfig",
        dict(num_key_value_heads=1, sliding_window=None, rope_theta=1000000.0),
        {},
    ),
    # Qwen 3: per-head RMSNorm of queries and keys (q_norm, k_norm), heads 16 wide where
    # hidden_size / heads is 8 (head_dim set apart, as Qwen3-30B-A3B's 32 x 128 on 2048),
    # tied embeddings.
    "qwen3_qk_norm": (
        "Qwen3Config",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        {},
    ),
    # Arcee with a tanh GELU: Llama with a non-gated MLP (up_proj, down_proj), the format
    # seqpipe's GPT (model.mlp=gelu) exports as.
    "arcee_gelu": (
        "ArceeConfig",
        dict(
            num_key_value_heads=2,
            hidden_act="gelu_pytorch_tanh",
            rope_theta=10000.0,
            bos_token_id=1,  # Arcee's defaults (128000, 128001) lie outside this vocabulary
            eos_token_id=2,
        ),
        {},
    ),
    # Mixtral: 4 experts (each intermediate_size wide), the top 2 renormalized; GQA.
    "mixtral_moe": (
        "MixtralConfig",
        dict(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
        ),
        {},
    ),
    # Qwen3-MoE: Qwen 3's attention (q_norm, k_norm, heads 16 wide on 32) with 4 experts
    # 24 wide (moe_intermediate_size; intermediate_size is dense layers', which it has
    # none of), the top 2 not renormalized (norm_topk_prob false).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        {},
    ),
    # Qwen3-MoE mixing dense and sparse layers: six layers, every second sparse
    # (decoder_sparse_step 2: layers 1, 3, 5) but layer 3 (mlp_only_layers), so that
    # each of two stages holds both kinds; dense layers are intermediate_size (48) wide,
    # experts 24; the top 2 renormalized (norm_topk_prob).
    "qwen3_moe_mixed": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        {},
    ),
    # Qwen 2 MoE: Qwen 2's attention (Q, K, V biases) with 4 experts 24 wide, the top 2 not
    # renormalized, and a shared expert 40 wide that every token goes through, scaled by
    # its sigmoid gate (shared_expert_gate).
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
        ),
        {},
    ),
}


def tokens(vocab_size: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, vocab_size, (BATCH, LENGTH + 1), np.int64)


def build(name: str):
    """The seeded model `name`, float32, every parameter drawn from the seed."""
    config_class, keys, _ = MODELS[name]
    return seeded(getattr(transformers, config_class)(**{"num_hidden_layers": 2, **TINY, **keys}))


def seeded(config):
    """A float32 model of `config` (eager attention) with every parameter drawn from SEED."""
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # a tied head is the embedding: drawn once
            if pname.endswith("norm.weight"):
                value = 0.5 + torch.rand(p.shape, generator=gen)  # gains in [0.5, 1.5)
            elif pname.endswith(".bias"):
                value = 0.5 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in pname:
                value = 0.3 * torch.randn(p.shape, generator=gen)
            else:  # [out, in], or the experts' [experts, out, in]
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(value)
    return model.eval()


def experts(model) -> bool:
    return hasattr(model.config, "num_experts_per_tok")


def router_logits(model, ids: np.ndarray, **inputs) -> list[np.ndarray]:
    """transformers' router logits of every layer, [B * L, X] each."""
    with torch.no_grad():
        # the base model: the head would add the aux loss, which a 4D mask breaks
        out = model.model(input_ids=torch.from_numpy(ids), output_router_logits=True, **inputs)
    return [x.float().numpy() for x in out.router_logits]


def router_aux(model, ids: np.ndarray) -> np.ndarray:
    """[layers]: transformers' load-balancing loss of each layer alone on row 0."""
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    config = model.config  # Qwen 2 MoE's config names the count num_experts alone
    x = getattr(config, "num_local_experts", None) or config.num_experts
    k = config.num_experts_per_tok
    length = ids.shape[1]
    return np.array(
        [
            float(balance((torch.from_numpy(r[:length]),), x, k))
            for r in router_logits(model, ids[:1])
        ]
    )


def margin(model, ids: np.ndarray, **inputs) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logit, over every layer."""
    k = model.config.num_experts_per_tok
    ranked = [-np.sort(-r, axis=-1) for r in router_logits(model, ids, **inputs)]
    return float(min(np.min(r[:, k - 1] - r[:, k]) for r in ranked))


def oracle(model, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers' float32 logits of every position of `ids` and its mean next-token loss."""
    with torch.no_grad():
        x = torch.from_numpy(ids)
        out = model(input_ids=x, labels=x, use_cache=False)
    return out.logits.float().numpy(), float(out.loss)


def inv_freq64(rotary) -> torch.Tensor:
    """A rotary embedding module's inverse frequencies in float64: transformers' own rope
    function of its type (default, llama3, linear, yarn, ...) run with `torch.float` and
    `torch.float32` standing for float64 (it builds them in float32)."""
    fn = rotary.compute_default_rope_parameters
    if rotary.rope_type != "default":
        fn = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rotary.rope_type]
    single = torch.float32
    torch.float = torch.float32 = torch.float64
    try:
        inv, scaling = fn(rotary.config)
    finally:
        torch.float = torch.float32 = single
    assert inv.dtype == torch.float64 and scaling == rotary.attention_scaling
    return inv


@contextlib.contextmanager
def _float64_throughout():
    """While it lasts, every float32 cast in transformers' forward (`.float()`,
    `.to(torch.float32)`, softmax's dtype=torch.float32) gives float64 instead."""
    to, float_, softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax
    up = lambda d: torch.float64 if d is torch.float32 else d  # noqa: E731

    def to64(self, *args, **kwargs):
        args = tuple(up(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = up(kwargs["dtype"])
        return to(self, *args, **kwargs)

    def softmax64(x, *args, dtype=None, **kwargs):
        return softmax(x, *args, dtype=up(dtype), **kwargs)

    torch.Tensor.to, torch.Tensor.float = to64, lambda self, *a, **k: self.double()
    torch.nn.functional.softmax = softmax64
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to, float_, softmax


def float64_model(model):
    """A float64 copy of `model` with RoPE's inverse frequencies recomputed in float64 (each
    float32 buffer `.double()` leaves is checked against them), experts run one by one
    (torch's grouped_mm, transformers' default for them, takes no float64)."""
    model64 = copy.deepcopy(model).double()
    if experts(model):
        model64.set_experts_implementation("eager")
    for module in model64.modules():
        if hasattr(module, "inv_freq"):
            inv = inv_freq64(module)
            assert torch.allclose(module.inv_freq, inv, rtol=1e-6, atol=0), module
            module.inv_freq, module.original_inv_freq = inv, inv.clone()
    return model64


def float64_oracle(model, ids: np.ndarray, **inputs) -> np.ndarray:
    """The logits of `model` computed in float64 throughout (`float64_model` under
    `_float64_throughout`), on `ids` or on packed rows given `packed_inputs`."""
    model64 = float64_model(model)
    with torch.no_grad(), _float64_throughout():
        out = model64(input_ids=torch.from_numpy(ids), use_cache=False, **inputs)
    assert out.logits.dtype == torch.float64
    return out.logits.numpy()


def float64_gaps(model, logits: np.ndarray, packed: np.ndarray) -> dict:
    """{float64_gap, float64_gap_packed}: max |float32 - float64| of oracle.npz's `logits`
    and oracle_packed.npz's `packed`."""
    ids = tokens(model.config.vocab_size)
    docs, pos = packed_rows()
    packed64 = float64_oracle(model, ids[:, :LENGTH], **packed_inputs(docs, pos))
    return {
        "float64_gap": float(np.max(np.abs(logits - float64_oracle(model, ids)))),
        "float64_gap_packed": float(np.max(np.abs(packed - packed64))),
    }


def write_gaps(name: str, out: Path) -> None:
    """oracle.json with `float64_gaps` of the fixture's committed logits, the rest as it was."""
    target = out / name
    model = build(name)
    logits = np.load(target / "oracle.npz")["logits"]
    packed = np.load(target / "oracle_packed.npz")["logits"]
    ids = tokens(model.config.vocab_size)
    # the committed model (to 1e-5 as tests/test_hf.py's live check: arcee's GELU differs
    # by 1.2e-6 from the committed logits on this machine)
    np.testing.assert_allclose(oracle(model, ids)[0], logits, atol=1e-5, err_msg=name)
    meta = json.loads((target / "oracle.json").read_text())
    meta.update(float64_gaps(model, logits, packed))
    (target / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{name}: float64 gap {meta['float64_gap']:.2e}, packed {meta['float64_gap_packed']:.2e}")


# Packed rows of LENGTH tokens (issue 35): documents of these lengths in order, then
# padding (document 0), positions restarted at each document.
PACKED_ROWS = ((7, 1, 20, 12), (25, 10))


def packed_rows() -> tuple[np.ndarray, np.ndarray]:
    """(documents, positions) int64 [BATCH, LENGTH] of PACKED_ROWS."""
    docs = np.zeros((BATCH, LENGTH), np.int64)
    pos = np.zeros_like(docs)
    for b, lengths in enumerate(PACKED_ROWS):
        at = 0
        for i, n in enumerate(lengths):
            docs[b, at : at + n], pos[b, at : at + n] = i + 1, np.arange(n)
            at += n
        pos[b, at:] = np.arange(LENGTH - at)
    return docs, pos


def packed_inputs(docs: np.ndarray, pos: np.ndarray) -> dict:
    """transformers' inputs for packed rows: a 4D float mask [B, 1, L, L], 0 where query i
    sees key j (j <= i, one document) and float32's lowest value elsewhere (eager attention
    adds it to the scores), and the positions restarted per document."""
    length = docs.shape[1]
    allowed = (docs[:, :, None] == docs[:, None, :]) & np.tril(np.ones((length, length), bool))
    mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    return dict(attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos))


def packed_oracle(model, ids: np.ndarray, docs: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """transformers' float32 logits of packed rows (`packed_inputs`)."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), use_cache=False, **packed_inputs(docs, pos))
    return out.logits.float().numpy()


def write(name: str, out: Path) -> None:
    model = build(name)
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target, **MODELS[name][2])
    tokenizer(model.config.vocab_size).save(str(target / "tokenizer.json"))
    ids = tokens(model.config.vocab_size)
    logits, loss = oracle(model, ids)
    arrays = dict(tokens=ids.astype(np.int32), logits=logits)
    if experts(model):
        arrays["router_aux"] = router_aux(model, ids)
    np.savez_compressed(target / "oracle.npz", **arrays)
    packed = write_packed(model, target)
    meta = {
        "loss": loss,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attention": "eager",
        "seed": SEED,
    }
    if experts(model):
        packed_margin = margin(model, ids[:, :LENGTH], **packed_inputs(*packed_rows()))
        meta["router_margin"] = min(margin(model, ids), packed_margin)
    meta.update(float64_gaps(model, logits, packed))
    (target / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
    spread = float(logits.std())
    print(f"{name}: loss {loss:.6f}, logit std {spread:.3f}, files {sorted(os.listdir(target))}")


def write_packed(model, target: Path) -> np.ndarray:
    """oracle_packed.npz: transformers' logits of PACKED_ROWS over the fixture's tokens
    (returned)."""
    ids = tokens(model.config.vocab_size)[:, :LENGTH]
    docs, pos = packed_rows()
    logits = packed_oracle(model, ids, docs, pos)
    i32 = lambda x: x.astype(np.int32)  # noqa: E731
    arrays = dict(tokens=i32(ids), documents=i32(docs), positions=i32(pos), logits=logits)
    np.savez_compressed(target / "oracle_packed.npz", **arrays)
    return logits


def tokenizer(vocab_size: int):
    """A character-level BPE (no merges; sentencepiece-style word marks, as Llama 2's)
    with `vocab_size` symbols: `--config hf:DIR` tokenizes with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = ["<unk>", "<|endoftext|>", "\u2581"] + [chr(c) for c in range(33, 126)]
    vocab = {s: i for i, s in enumerate(symbols[:vocab_size])}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.add_special_tokens(["<unk>", "<|endoftext|>"])
    return t


def bf16_copy(out: Path) -> None:
    """qwen2_bias with its weights in bfloat16: the round trip keeps a dtype numpy lacks."""
    model = build("qwen2_bias").to(torch.bfloat16)
    target = out / "qwen2_bias_bf16"
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target)
    print(f"qwen2_bias_bf16: files {sorted(os.listdir(target))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "tests/fixtures/hf"))
    parser.add_argument(
        "--packed_only", action="store_true", help="(re)write only oracle_packed.npz"
    )
    parser.add_argument(
        "--gap_only",
        action="store_true",
        help="add float64_gap and float64_gap_packed to each oracle.json, nothing else",
    )
    parser.add_argument("--only", choices=MODELS, help="(re)write this fixture alone")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in [args.only] if args.only else MODELS:
        if args.gap_only:
            write_gaps(name, out)
        elif args.packed_only:
            write_packed(build(name), out / name)
        else:
            write(name, out)
    if not args.packed_only and not args.gap_only and not args.only:
        bf16_copy(out)
