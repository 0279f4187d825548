"""Make torch's gradient and training-run fixtures for two HF fixtures (tests/test_torch_oracle.py).

    .venv/bin/pip install torch==2.13.0 transformers safetensors   # a CPU torch
    .venv/bin/python scripts/make_torch_oracle.py [--out tests/fixtures/hf]

Needs the fixtures of scripts/make_hf_fixtures.py. For `llama_gqa_llama3` (GQA, llama3
rope scaling) and `qwen2_bias` (Q/K/V biases), in float64 with eager attention:

- `grads.npz`: the mean next-token loss of the fixture's tokens and every parameter's
  gradient, by its HF name; `grads_packed.npz`: the same on packed rows (documents masked
  apart by a block-diagonal causal mask, positions restarted, the loss over the targets
  inside a document), with the rows' `documents` and `positions`.
- `trajectory.npz` (llama_gqa_llama3): ten steps of `torch.optim.AdamW` with linear
  warm-up, cosine decay, global-norm clipping and weight decay off the norms (`RECIPE`,
  seqpipe's `train.*` keys) on a token file of four windows, every step on all four (so
  the order seqpipe's loader shuffles them in changes no mean): the tokens, the ten
  losses and every final parameter.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from make_hf_fixtures import tokens

MODELS = ("llama_gqa_llama3", "qwen2_bias")
# seqpipe's train.* keys of the training run, and what torch is given for each.
RECIPE = dict(
    steps=10,
    warmup_steps=3,
    learning_rate=1e-2,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    grad_clip=1.0,
    b1=0.9,
    b2=0.95,
    seq_len=32,
    global_batch_size=4,
)
EPS = 1e-8  # optax.adamw's and torch's default


def _norm_forward(self, x):
    """HF's RMSNorm in the input's dtype (HF computes it in float32 whatever the model's)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_forward(self, x, position_ids):
    """HF's rotary embedding in the dtype of its inverse frequencies (HF: float32)."""
    freqs = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
    return cos.to(x.dtype), sin.to(x.dtype)


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """HF's eager attention with its softmax in the query's dtype (HF: float32)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    keys = repeat_kv(key, module.num_key_value_groups)
    values = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def load(directory: Path):
    """The fixture's model computed in float64 throughout, eager attention: transformers
    computes RMSNorm, RoPE's frequencies and angles and the attention softmax in float32
    even in a float64 model (a relative error near 1e-7, the size of the float32 noise
    these fixtures measure), so those run in float64 here, and the frequencies are built
    with `torch.float` standing for float64."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for m, prefix in ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2")):
        getattr(m, f"{prefix}RMSNorm").forward = _norm_forward
        getattr(m, f"{prefix}RotaryEmbedding").forward = _rotary_forward
        m.eager_attention_forward = _eager_attention
    single, torch.float = torch.float, torch.float64
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float64, attn_implementation="eager"
        )
    finally:
        torch.float = single
    assert all(m.inv_freq.dtype == torch.float64 for m in model.modules() if hasattr(m, "inv_freq"))
    return model.train()


def packed(length: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents, positions) [rows, length]: documents of 7, 1, 20, 12 and 25, 10
    tokens (then padding, document 0), positions restarted at each document."""
    layouts = ((7, 1, 20, 12), (25, 10))
    docs = np.zeros((rows, length), np.int64)
    pos = np.zeros_like(docs)
    for b in range(rows):
        at = 0
        for i, n in enumerate(layouts[b % len(layouts)]):
            docs[b, at : at + n], pos[b, at : at + n] = i + 1, np.arange(n)
            at += n
        pos[b, at:] = np.arange(length - at)
    return docs, pos


def mean_loss(model, ids: np.ndarray, docs: np.ndarray | None = None, pos=None):
    """The mean next-token cross-entropy of `ids` [B, L+1]; with `docs` and `pos`
    [B, L+1] (packed rows) the mean over the targets in their input's document."""
    x, y = torch.from_numpy(ids[:, :-1]), torch.from_numpy(ids[:, 1:])
    if docs is None:
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    d = docs[:, :-1]
    length = d.shape[1]
    allowed = (d[:, :, None] == d[:, None, :]) & np.tril(np.ones((length, length), bool))
    mask = np.where(allowed, 0.0, np.finfo(np.float64).min)[:, None]
    logits = model(
        input_ids=x,
        attention_mask=torch.from_numpy(mask),
        position_ids=torch.from_numpy(pos[:, :-1]),
        use_cache=False,
    ).logits
    counted = torch.from_numpy((docs[:, 1:] != 0) & (docs[:, 1:] == docs[:, :-1]))
    each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return (each * counted.reshape(-1)).sum() / counted.sum()


def gradients(model, *batch) -> dict[str, np.ndarray]:
    model.zero_grad()
    loss = mean_loss(model, *batch)
    loss.backward()
    out = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    return {"loss": np.float64(loss.item()), **out}


def write_gradients(name: str, out: Path) -> None:
    model = load(out / name)
    ids = tokens(model.config.vocab_size)
    np.savez_compressed(
        out / name / "grads.npz", tokens=ids.astype(np.int32), **gradients(model, ids)
    )
    docs, pos = packed(ids.shape[1], ids.shape[0])
    arrays = gradients(model, ids, docs, pos)
    i32 = lambda x: x.astype(np.int32)  # noqa: E731
    np.savez_compressed(
        out / name / "grads_packed.npz",
        tokens=i32(ids),
        documents=i32(docs),
        positions=i32(pos),
        **arrays,
    )
    print(f"{name}: loss {float(arrays['loss']):.6f} packed, {len(arrays) - 1} gradients")


def learning_rate(step: int) -> float:
    """optax.warmup_cosine_decay_schedule(0, peak, warmup, steps, peak * min_lr_ratio) at
    `step` updates applied: 0 at the first step."""
    r = RECIPE
    peak, warmup, steps = r["learning_rate"], r["warmup_steps"], r["steps"]
    if step < warmup:
        return peak * step / warmup
    end = peak * r["min_lr_ratio"]
    t = min(step - warmup, steps - warmup) / (steps - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


def write_trajectory(name: str, out: Path) -> None:
    model = load(out / name)
    r = RECIPE
    rows, length = r["global_batch_size"], r["seq_len"]
    rng = np.random.default_rng(7)
    # Four training windows of length + 1 (stride length), then one held out (seqpipe
    # keeps the last max(2%, one window) of the tokens for evaluation).
    stream = rng.integers(0, model.config.vocab_size, rows * length + 1 + length + 1)
    batch = np.stack([stream[i * length : i * length + length + 1] for i in range(rows)])
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    kept = [p for n, p in model.named_parameters() if "norm" in n]
    groups = [
        {"params": decay, "weight_decay": r["weight_decay"]},
        {"params": kept, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=r["learning_rate"], betas=(r["b1"], r["b2"]), eps=EPS)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s) / r["learning_rate"])
    losses = []
    for _ in range(r["steps"]):
        opt.zero_grad()
        loss = mean_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
        opt.step()
        lr.step()
        losses.append(loss.item())
    final = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    np.savez_compressed(
        out / name / "trajectory.npz",
        stream=stream.astype(np.uint16),
        losses=np.array(losses),
        **final,
    )
    print(f"{name}: losses {', '.join(f'{x:.5f}' for x in losses)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "tests/fixtures/hf"))
    out = Path(parser.parse_args().out)
    torch.use_deterministic_algorithms(True)
    for name in MODELS:
        write_gradients(name, out)
    write_trajectory("llama_gqa_llama3", out)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "recipe": RECIPE}
    (out / "torch_oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
