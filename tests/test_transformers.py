"""flashgen.integrations.transformers on tiny random-initialised models (fp32, CPU) against the
same models with attn_implementation="eager": logits and gradients at the non-padded positions
(padded, left and right, and unpadded batches, training mode with dropout 0), packed sequences,
greedy generation with dynamic and static caches, and the fallbacks."""

import re
import warnings
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.integrations import transformers as fg_hf
from flashgen.integrations import transformers_blocks

VOCAB = 96
DECODERS = ("llama", "mistral", "gemma2", "gpt2")
MODELS = (*DECODERS, "bert")


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """Register the backend and build its two specs' CPU kernels at once (in parallel)."""
    fg_hf.register()
    fg_hf.build("cpu", ["fp32"])


def config(name: str):
    """Two layers, hidden 32, 4 heads; GQA, sliding windows shorter than the inputs, soft-capping
    and a scale other than 1/sqrt(d) where the model has them; no dropout."""
    t = transformers
    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64, "initializer_range": 0.3}
    if name == "llama":
        return t.LlamaConfig(**common, num_key_value_heads=2)
    if name == "mistral":
        return t.MistralConfig(**common, num_key_value_heads=1, sliding_window=5)
    if name == "gemma2":
        return t.Gemma2Config(**common, num_key_value_heads=2, head_dim=16, sliding_window=5,
                              attn_logit_softcapping=3.0, final_logit_softcapping=30.0, query_pre_attn_scalar=4,
                              layer_types=["sliding_attention", "full_attention"])
    if name == "gpt2":
        return t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                            resid_pdrop=0.0, embd_pdrop=0.0, initializer_range=0.3)
    if name == "bert":
        return t.BertConfig(**common, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    raise ValueError(name)


_models: dict = {}


def model(name: str):
    """One model per name for the module (random weights, seed 0), set to eager attention."""
    if name not in _models:
        torch.manual_seed(0)
        cls = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
        m = cls.from_config(config(name), attn_implementation="eager")
        if name != "bert":
            m.generation_config.pad_token_id = 0
        _models[name] = m
    m = _models[name]
    m.set_attn_implementation("eager")
    return m


def batch(padding: str, n: int = 12, seed: int = 1):
    """Three rows of n tokens: unpadded, or with 0, 3 and 7 padding tokens on the left or right."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, n), generator=g)
    mask = torch.ones(3, n, dtype=torch.long)
    if padding != "none":
        for row, pad in enumerate((0, 3, 7)):
            cols = slice(0, pad) if padding == "left" else slice(n - pad, n)
            mask[row, cols] = 0
            ids[row, cols] = 0
    return ids, mask


def run(m, impl: str, ids, mask, weights, **kw):
    """Logits and parameter gradients of sum(logits * weights) over the non-padded positions."""
    m.set_attn_implementation(impl)
    m.train()
    m.zero_grad(set_to_none=True)
    logits = m(input_ids=ids, attention_mask=mask, **kw).logits
    keep = mask.bool()
    (logits * weights)[keep].sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.set_attn_implementation("eager")
    return logits.detach()[keep], grads


class GraphCalls:
    """A torch.compile backend (aot_eager underneath: dynamo traces as for inductor) that counts the
    flashgen ops of the graphs it compiles each time a graph runs, by spec name ("kvcache:<spec>"
    for op.with_kvcache's op): the calls of compiled models, which fg_hf.call_counts leaves out."""

    def __init__(self):
        self.calls = Counter()
        self.sdpa = 0  # graphs calling torch's SDPA (transformers' fallback)

    def __call__(self, gm, example_inputs):
        ops = Counter()
        for node in gm.graph.nodes:
            target = str(node.target) if node.op == "call_function" else ""
            self.sdpa += "scaled_dot_product_attention" in target
            for name in fg_hf.SPECS:
                qual = fg_hf.op(name).name.split("::")[1]
                if target.startswith(f"flashgen.{qual}."):
                    ops[name] += 1
                elif target.startswith(f"flashgen.{qual}_kvcache."):
                    ops[f"kvcache:{name}"] += 1
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.calls.update(ops)
            return compiled(*args)
        return run


def assert_same(ref, ours, what: str, tol: float = 2e-5):
    scale = ref.abs().max().item() + 1e-6
    err = (ref - ours).abs().max().item()
    assert err <= tol * max(1.0, scale), f"{what}: max error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_match_eager(name, padding):
    m = model(name)
    ids, mask = batch(padding)
    weights = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(2))
    before = dict(fg_hf.call_counts)
    ref_logits, ref_grads = run(m, "eager", ids, mask, weights)
    logits, grads = run(m, "fgen", ids, mask, weights)
    ran = {k: v - before.get(k, 0) for k, v in fg_hf.call_counts.items() if v != before.get(k, 0)}
    assert set(ran) <= set(fg_hf.SPECS) and sum(ran.values()) == 2, ran  # two layers, no fallback
    assert_same(ref_logits, logits, "logits")
    assert ref_grads.keys() == grads.keys()
    for n in ref_grads:
        assert_same(ref_grads[n], grads[n], f"grad of {n}")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_match_eager(name):
    """Sequences packed into rows (position_ids restarting; transformers' eager mask keeps them
    apart), and the same with explicit cu_seq_lens / max_length (a packed call)."""
    m = model(name)
    lengths = [[5, 7], [3, 2, 7]]
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    mask = torch.ones_like(ids)
    weights = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(4))

    def go(impl, **kw):  # no attention_mask, as packed training passes: the packing is in position_ids
        m.set_attn_implementation(impl)
        m.train()
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits
        (logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.set_attn_implementation("eager")
        return logits.detach(), grads

    ref_logits, ref_grads = go("eager")
    whole, _ = go("eager", attention_mask=mask)  # not packed: one sequence per row
    assert (whole - ref_logits).abs().max() > 1e-3  # the packing changes the result
    before, packed_before = Counter(fg_hf.call_counts), Counter(fg_hf.packed_calls)
    logits, grads = go("fgen")
    ran = fg_hf.call_counts - before
    assert ran and not [k for k in ran if k.startswith("fallback")], ran  # the packed mask function recognised
    assert fg_hf.packed_calls - packed_before == ran  # every layer ran as a packed call
    assert_same(ref_logits, logits, "logits")
    for n in ref_grads:
        assert_same(ref_grads[n], grads[n], f"grad of {n}")
    starts = [0]
    for row in lengths:
        for n in row:
            starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32)
    packed_before = Counter(fg_hf.packed_calls)
    logits, _ = go("fgen", cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    assert_same(ref_logits, logits, "logits with cu_seq_lens")
    assert sum((fg_hf.packed_calls - packed_before).values()) == 2  # both layers, packed


def test_training_under_torch_compile_runs_flashgen(monkeypatch):
    """Under torch.compile transformers always builds packed sequence ids from position_ids in
    training (its packing check is data-dependent): the backend runs them as a padded call with
    per-token sequence ids (specs/transformers_packed_plain.attn for Mistral's layers, without
    soft-capping or dropout; no host read) instead of falling back;
    logits and gradients equal eager attention's, packed rows included. The model traces without a
    graph break (the mask pattern is read from the mask function's torch calls, not its closure),
    each attention call is the registered op in the graph, and nothing is added to call_counts
    there (a counter read while tracing would recompile every step). The same ids path, forced
    outside compile, equals the varlen path it replaces."""
    m = model("mistral")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([list(range(12)), [*range(5), *range(7)]])  # row 1 holds two sequences
    weights = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(6))

    def go(impl, fn):
        m.set_attn_implementation(impl)
        m.train()
        m.zero_grad(set_to_none=True)
        logits = fn(input_ids=ids, position_ids=pos, use_cache=False).logits
        (logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.set_attn_implementation("eager")
        return logits.detach(), grads

    ref_logits, ref_grads = go("eager", m)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fg_hf.call_counts.clear()
    fg_hf.block_list_calls.clear()
    backend = GraphCalls()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logits, grads = go("fgen", torch.compile(m, backend=backend))
    assert not [w for w in seen if "flashgen" in str(w.message)], [str(w.message) for w in seen]  # no fallback
    assert backend.calls == {"transformers_packed_plain": 2} and not backend.sdpa, backend.calls  # two layers, in graph
    # one block classification for the step's forward and backward of both layers (the lists op's
    # calls, identical in every layer, merged by AOTAutograd's common-subexpression pass)
    assert fg_hf.block_list_calls == {"transformers_packed": 1}, dict(fg_hf.block_list_calls)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert not fg_hf.call_counts, dict(fg_hf.call_counts)
    assert_same(ref_logits, logits, "logits")
    for n in ref_grads:
        assert_same(ref_grads[n], grads[n], f"grad of {n}")
    torch._dynamo.reset()
    varlen, _ = go("fgen", m)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    padded, _ = go("fgen", m)
    assert_same(varlen, padded, "sequence ids against the varlen call")


def compiled_training(name: str, impl: str, steps: int = 4):
    """``steps`` AdamW steps of a fresh ``model(name)``-shaped model compiled with backend="eager"
    (dynamo only, as scripts/e2e_gpt2.py --smoke), each on a new batch: the losses, and after each
    step the frames dynamo has compiled and its graph breaks so far."""
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config(name), attn_implementation=impl)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    step = torch.compile(m, backend="eager")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    losses, frames, breaks = [], [], []
    for i in range(steps):
        ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + i))
        loss = step(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        frames.append(counters["frames"]["ok"])
        breaks.append(sum(counters["graph_break"].values()))
    torch._dynamo.reset()
    return losses, frames, breaks


@pytest.mark.parametrize("name", ["gpt2", "gemma2"])
def test_compiled_training_does_not_recompile(name):
    """Training steps of a compiled model compile in the first step and never again (a per-call
    counter or anything else that changes from call to call in the attention or mask functions
    recompiled every step, until dynamo's recompile limit left the model uncompiled); flashgen
    adds no graph break to those of the model's own code (as compiled with eager attention), and
    the losses equal eager attention's, uncompiled."""
    fg_hf._warned.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses, frames, breaks = compiled_training(name, "fgen")
    assert not [w for w in seen if "flashgen" in str(w.message)], [str(w.message) for w in seen]  # no fallback
    assert frames[0] > 0 and frames[1:] == frames[:1] * (len(frames) - 1), frames  # no recompilation
    _, _, eager_breaks = compiled_training(name, "eager")
    assert breaks[-1] <= eager_breaks[-1], (breaks, eager_breaks)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config(name), attn_implementation="eager")
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for i, loss in enumerate(losses):
        ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + i))
        ref = m(input_ids=ids, labels=ids, use_cache=False).loss
        ref.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert loss == pytest.approx(ref.item(), rel=1e-5, abs=1e-6), (i, losses)


def _mask_functions(pos, ids):
    """transformers' mask functions by name, with the pattern flashgen recognises in each:
    (kind, whether packed sequence ids come with it), or None (falls back); and whether
    torch.compile traces its recognition without a graph break (from its torch calls: not those of
    the builtin abs, which dynamo does not show a torch function mode, nor a pattern that falls
    back, both read from the closure outside the tracing)."""
    mu = transformers.masking_utils
    lp = torch.zeros(pos.shape[0], dtype=torch.long)
    same = mu.packed_sequence_mask_function(ids)
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)

    def packed(fn):  # newer transformers: the pattern on positions remapped into each sequence
        return mu.and_masks(remap(fn, pos), same)

    def packed_rows(fn):  # transformers 5.17: the pattern on the row's own indices
        return mu.and_masks(fn, same)

    fns = {
        "causal": (mu.causal_mask_function, ("causal", False), True),
        "bidirectional": (mu.bidirectional_mask_function, ("bidirectional", False), True),
        "sliding": (mu.sliding_window_causal_mask_function(4), ("causal", False), True),
        "sliding bidirectional": (mu.sliding_window_bidirectional_mask_function(3), ("bidirectional", False), False),
        "chunked": (mu.chunked_causal_mask_function(4, lp), None, False),
        "or overlay": (mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function), None, False),
        "and overlay": (mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv >= 1), None, False),
        "padding": (mu.padding_mask_function(torch.ones_like(ids, dtype=torch.bool)), None, False),
        "offsets": (mu.add_offsets_to_mask_function(mu.causal_mask_function, 2, 0), None, False),
        "and packed ids": (mu.and_masks(mu.padding_mask_function(torch.ones_like(ids, dtype=torch.bool)), same),
                           None, False),
        "block_sequence_ids, rows": (mu.or_masks(packed_rows(mu.causal_mask_function), mu.blockwise_overlay(ids)),
                                     None, False),
    }
    for suffix, form in (("", packed), (", rows", packed_rows)) if remap is not None else ((", rows", packed_rows),):
        fns.update({
            f"packed{suffix}": (form(mu.causal_mask_function), ("causal", True), True),
            f"packed sliding{suffix}": (form(mu.sliding_window_causal_mask_function(4)), ("causal", True), True),
            f"packed bidirectional{suffix}": (form(mu.bidirectional_mask_function), ("bidirectional", True), True),
            f"packed sliding bidirectional{suffix}": (form(mu.sliding_window_bidirectional_mask_function(2)),
                                                      ("bidirectional", True), False),
            f"packed chunked{suffix}": (form(mu.chunked_causal_mask_function(4, lp)), None, False),
            f"packed block_sequence_ids{suffix}": (
                form(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))), None, False),
        })
    return fns


@pytest.mark.parametrize("which", list(_mask_functions(torch.zeros(1, 1), torch.zeros(1, 1))))
def test_mask_pattern_read_from_torch_calls_as_from_closures(which):
    """The mask pattern read from a mask function's torch calls on probe indices (as under
    torch.compile, where closures are out of reach) is the one read from its closure cells (as in
    eager mode); traced by dynamo, with the mask function built inside the compiled function as
    transformers builds it, the pattern is the same, without a graph break where the torch calls
    show it."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    fn, want, unbroken = _mask_functions(pos, ids)[which]

    def read(got):
        return None if got is None else (got[0], got[1] is not None)

    closure = fg_hf._composed_pattern(fn) if fn.__qualname__.count("<locals>") else fg_hf._pattern(fn)
    assert read(closure) == want
    probe = fg_hf._traced_pattern(fn, "cpu")
    assert read(probe) == want
    if want is not None and want[1]:
        assert probe[1] is ids and closure[1] is ids

    def traced(pos, ids):
        got = fg_hf._pattern(_mask_functions(pos, ids)[which][0], pos.device)
        return (None, None) if got is None else got

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    kind, got_ids = torch.compile(traced, backend="eager")(pos, ids)
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    assert (None if kind is None else (kind, got_ids is not None)) == want
    if got_ids is not None:
        assert torch.equal(got_ids, ids)
    assert (breaks == 0) == unbroken, dict(counters["graph_break"])


def greedy(m, impl, ids, mask, cache):
    m.set_attn_implementation(impl)
    m.eval()
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         cache_implementation=cache, return_dict_in_generate=True, output_logits=True)
    m.set_attn_implementation("eager")
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # [B, 20], [B, 20, V]


@pytest.mark.parametrize("cache,padding", [("dynamic", "left"), ("static", "left"), ("static", "none")])
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generation_matches_eager(name, cache, padding, capsys):
    """20 greedy tokens from a left-padded or unpadded batch (generate then passes no mask: a static
    cache's valid slots come from its offset alone) equal eager's, except from a step where eager's
    top-2 logit margin is below 1e-4 (a tie within rounding; reported)."""
    m = model(name)
    ids, mask = batch(padding, n=8, seed=5)
    before = sum(fg_hf.call_counts[s] for s in fg_hf.SPECS)
    decodes = sum(fg_hf.kvcache_calls.values())
    ref, ref_logits = greedy(m, "eager", ids, mask, cache)
    ours, _ = greedy(m, "fgen", ids, mask, cache)
    assert sum(fg_hf.call_counts[s] for s in fg_hf.SPECS) - before == 2 * 20  # prefill + 19 steps, 2 layers
    assert sum(fg_hf.kvcache_calls.values()) - decodes == 2 * 19  # the steps ran op.with_kvcache
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    for row in range(ids.shape[0]):
        diff = (ref[row] != ours[row]).nonzero()
        if len(diff):
            step = int(diff[0])
            assert margin[row, step] < 1e-4, f"row {row} differs at step {step} (margin {margin[row, step]:.3g})"
            with capsys.disabled():
                print(f"\n{name}/{cache}/{padding}: row {row} differs from step {step}, where eager's top-2 margin is "
                      f"{margin[row, step]:.2g}")
    assert len(set(ref.flatten().tolist())) > 2  # the model does not just repeat one token


def test_compiled_generation_on_a_static_cache_decodes_through_with_kvcache():
    """Greedy generation with a static cache and the model's forward under torch.compile (as
    transformers compiles decoding steps), Mistral's sliding window on a left-padded batch: every
    step after the prefill runs op.with_kvcache (the split-KV decode kernels on CUDA) inside the
    compiled graph, without a graph break, and gives eager's tokens."""
    m = model("mistral")
    ids, mask = batch("left", n=8, seed=5)
    ref, _ = greedy(m, "eager", ids, mask, "static")
    forward = m.forward
    backend = GraphCalls()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    m.forward = torch.compile(forward, backend=backend)
    try:
        ours, _ = greedy(m, "fgen", ids, mask, "static")
        assert backend.calls == {"transformers": 2, "kvcache:transformers": 2 * 19}, backend.calls
        assert not backend.sdpa and not torch._dynamo.utils.counters["graph_break"]
    finally:
        m.forward = forward
        torch._dynamo.reset()
    assert torch.equal(ref, ours)


def test_decoding_step_follows_autocast_as_the_prefill_call_does():
    """A one-query step of fp32 q, k, v under a bf16 autocast computes in bf16, as the prefill op
    does: the backend casts q, k and v to autocast's dtype first (as SDPA sees them under
    autocast), then takes op.with_kvcache; without autocast it computes in fp32."""
    layer = torch.nn.Module()
    layer.is_causal = True
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen) for h, n in ((4, 1), (2, 12), (2, 12)))
    with torch.no_grad():
        for autocast, dtype, decodes in ((False, torch.float32, 1), (True, torch.float32, 1), (True, torch.bfloat16, 1)):
            before = sum(fg_hf.kvcache_calls.values())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out, _ = fg_hf.attention_forward(layer, q.to(dtype), k.to(dtype), v.to(dtype), None)
            assert sum(fg_hf.kvcache_calls.values()) - before == decodes
            assert out.dtype == (torch.bfloat16 if autocast else torch.float32)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_autocast_mixed_dtypes_run_flashgen(name):
    """Under a bf16 autocast a rotary model's query and key leave RoPE in fp32 while its value is
    bf16: the backend casts the three to autocast's dtype (as SDPA's autocast rule does) and runs
    its kernels, with no fallback, matching SDPA (Gemma 2: eager, which soft-caps) under the same
    autocast to bf16 rounding."""
    m = model(name)
    ids, mask = batch("left")
    keep = mask.bool()
    ref_impl = "eager" if name == "gemma2" else "sdpa"
    m.eval()
    fg_hf._warned.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m.set_attn_implementation(ref_impl)
        ref = m(input_ids=ids, attention_mask=mask).logits.float()
        m.set_attn_implementation("fgen")
        before = sum(n for k, n in fg_hf.call_counts.items() if not k.startswith("fallback"))
        fallbacks = sum(n for k, n in fg_hf.call_counts.items() if k.startswith("fallback"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning
            ours = m(input_ids=ids, attention_mask=mask).logits.float()
        m.set_attn_implementation("eager")
    assert sum(n for k, n in fg_hf.call_counts.items() if not k.startswith("fallback")) - before == 2  # 2 layers
    assert sum(n for k, n in fg_hf.call_counts.items() if k.startswith("fallback")) == fallbacks
    assert_same(ref[keep], ours[keep], f"{name} logits under bf16 autocast", tol=3e-2)


def test_fallback_under_compile_warns_without_a_graph_break():
    """A fallback under torch.compile (here a user's 4-D bool mask) warns once, when dynamo
    traces the call, costs no graph break (SDPA's model compiles with none either) and gives
    SDPA's result uncompiled."""
    m = model("llama")
    ids, _ = batch("none")
    n = ids.shape[1]
    m4 = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None].expand(ids.shape[0], 1, n, n).clone()
    m.eval()
    m.set_attn_implementation("fgen")
    fg_hf._warned.clear()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        cm = torch.compile(m, backend="eager")
        with warnings.catch_warnings(record=True) as seen, torch.no_grad():
            warnings.simplefilter("always")
            ours = [cm(input_ids=ids, attention_mask=m4).logits for _ in range(2)]
        breaks, frames = sum(counters["graph_break"].values()), counters["frames"]["ok"]
        m.set_attn_implementation("sdpa")  # (transformers' eager attention adds a bool mask as numbers)
        with torch.no_grad():
            ref = m(input_ids=ids, attention_mask=m4).logits
    finally:
        m.set_attn_implementation("eager")
        torch._dynamo.reset()
    assert len([w for w in seen if "4-D attention_mask" in str(w.message)]) == 1, [str(w.message) for w in seen]
    assert breaks == 0 and frames == 1, (breaks, frames)
    for out in ours:
        assert_same(ref, out, "logits with a 4-D mask, compiled")


def test_traced_functions_import_nothing():
    """The functions dynamo traces in a compiled model hold no import statement: with the torch
    2.11 of the GPU machine an import of transformers' lazily loaded package inside traced code was
    a graph break ("Bad import result": dynamo there accepts only an exact module type), four per
    compiled GPT-2 step; transformers' modules are imported once by register() instead."""
    import dis

    traced = [fg_hf.mask_forward, fg_hf._pattern, fg_hf._traced_pattern, fg_hf.attention_forward,
              fg_hf._fallback, fg_hf._fallback_reason, fg_hf._warn_once, fg_hf._autocast_inputs, fg_hf._window,
              fg_hf._decodes, transformers_blocks.packed_attention]
    for fn in traced:
        codes, found = [fn.__code__], []
        while codes:
            code = codes.pop()
            found += [i.argval for i in dis.get_instructions(code) if i.opname == "IMPORT_NAME"]
            codes += [c for c in code.co_consts if hasattr(c, "co_code")]
        assert not found, f"{fn.__name__} imports {found} while dynamo traces it"
    fg_hf.register("fgen")
    assert {"masking_utils", "sdpa_attention"} <= set(fg_hf._tf)


def test_compiled_training_over_changing_lengths_recompiles_as_sdpa_does():
    """Padded training batches of changing lengths under torch.compile: flashgen's model compiles
    as many frames as SDPA's (the decode test on a training call read its length first, a guard
    that recompiled when the length crossed 16)."""
    frames = {}
    for impl in ("fgen", "sdpa"):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config("llama"), attn_implementation=impl)
        m.train()
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        cm = torch.compile(m, backend="eager")
        for step, n in enumerate((8, 12, 16, 20, 24, 28)):
            ids, mask = batch("left" if step % 2 else "right", n=n, seed=step)
            cm(input_ids=ids, attention_mask=mask).logits.sum().backward()
        frames[impl] = counters["frames"]["ok"]
        torch._dynamo.reset()
    assert frames["fgen"] <= frames["sdpa"], frames


def test_fallbacks_warn_once_and_match_eager():
    """A user's 4-D float mask and output_attentions=True leave flashgen's kernels with a warning
    naming the reason, and give eager's result."""
    m = model("llama")
    ids, mask = batch("left")
    n = ids.shape[1]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    keep = causal[None, None] & mask.bool()[:, None, None, :]
    additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    m.eval()
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=additive).logits
        m.set_attn_implementation("fgen")
        fg_hf._warned.clear()
        with pytest.warns(UserWarning, match="4-D attention_mask"):
            ours = m(input_ids=ids, attention_mask=additive).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m(input_ids=ids, attention_mask=additive)  # warned once
        with pytest.warns(UserWarning, match="output_attentions"):
            out = m(input_ids=ids, attention_mask=mask, output_attentions=True)
        m.set_attn_implementation("eager")
        ref_att = m(input_ids=ids, attention_mask=mask, output_attentions=True)
    keep2 = mask.bool()
    assert_same(ref[keep2], ours[keep2], "logits with a 4-D mask")
    assert_same(ref_att.logits[keep2], out.logits[keep2], "logits with output_attentions")
    assert out.attentions is not None and len(out.attentions) == 2


def test_dropout_in_training():
    """Attention dropout in training runs in the kernels (a new mask per call, gradients flow);
    in eval mode the same model gives eager's result."""
    m = model("gpt2")
    ids, mask = batch("left")
    for block in m.transformer.h:
        block.attn.attn_dropout.p = 0.5
    try:
        m.set_attn_implementation("fgen")
        m.train()
        before = fg_hf.call_counts["transformers"]
        a = m(input_ids=ids, attention_mask=mask).logits
        b = m(input_ids=ids, attention_mask=mask).logits
        assert fg_hf.call_counts["transformers"] - before == 4
        keep = mask.bool()
        assert (a - b)[keep].abs().max() > 1e-3  # a fresh dropout mask per call
        a[keep].sum().backward()
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        m.eval()
        with torch.no_grad():
            ours = m(input_ids=ids, attention_mask=mask).logits
            m.set_attn_implementation("eager")
            ref = m(input_ids=ids, attention_mask=mask).logits
        assert_same(ref[keep], ours[keep], "eval-mode logits")
    finally:
        for block in m.transformer.h:
            block.attn.attn_dropout.p = 0.0
        m.zero_grad(set_to_none=True)
        m.set_attn_implementation("eager")


def test_fallback_warning_once_per_reason_and_fallback():
    """The one-time fallback warning is kept per (reason, attention run instead): a reason that
    sent one model's calls to SDPA and then another's to eager attention (e.g. a head dim
    flashgen does not build, in a model with soft-capping) warns for both, each once."""
    fg_hf._warned.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for instead in ("sdpa", "eager", "sdpa", "eager"):
            fg_hf._warn_now("head dim 264", instead, stacklevel=2)
    got = [str(w.message) for w in seen if "flashgen" in str(w.message)]
    assert len(got) == 2 and "sdpa" in got[0] and "eager" in got[1], got
    fg_hf._warned.clear()


def test_compiled_packed_ids_without_block_lists(monkeypatch):
    """FLASHGEN_AUTO_BLOCK_MASK=0 (read when dynamo traces): the packed-sequence calls of a
    compiled training step take no block lists (no classification runs) and give the same logits
    and gradients as with them."""
    m = model("mistral")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    pos = torch.tensor([list(range(12)), [*range(4), *range(8)]])

    def step():
        torch._dynamo.reset()
        m.set_attn_implementation("fgen")
        m.train()
        m.zero_grad(set_to_none=True)
        logits = torch.compile(m, backend="aot_eager")(input_ids=ids, position_ids=pos, use_cache=False).logits
        logits.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.set_attn_implementation("eager")
        return logits.detach(), grads

    try:
        fg_hf.block_list_calls.clear()
        with_lists = step()
        assert fg_hf.block_list_calls == {"transformers_packed": 1}, dict(fg_hf.block_list_calls)
        monkeypatch.setenv("FLASHGEN_AUTO_BLOCK_MASK", "0")
        fg_hf.block_list_calls.clear()
        without = step()
        assert not fg_hf.block_list_calls, dict(fg_hf.block_list_calls)
    finally:
        torch._dynamo.reset()
    assert_same(with_lists[0], without[0], "logits")
    for n in with_lists[1]:
        assert_same(with_lists[1][n], without[1][n], f"grad of {n}")


def test_unsupported_pattern_warns_once_with_its_reason():
    """A mask pattern without a flashgen spec (Llama 4's chunked attention): the mask function
    warns for it and returns transformers' 4-D mask, and the attention function falls back on
    that mask for the same reason, not as for a user's 4-D mask (no second, misleading
    warning); the logits are SDPA's."""
    cfg_cls = getattr(transformers, "Llama4TextConfig", None)
    if cfg_cls is None:
        pytest.skip("this transformers has no Llama 4")
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                  attention_chunk_size=5, no_rope_layers=[1, 0])
    torch.manual_seed(0)
    m = transformers.Llama4ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(1, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(ids).logits
        fg_hf._warned.clear()
        m.set_attn_implementation("fgen")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ours = m(ids).logits
        m.set_attn_implementation("sdpa")
    got = [str(w.message) for w in seen if "flashgen.integrations.transformers" in str(w.message)]
    assert len(got) == 1 and "has no flashgen spec" in got[0], got
    assert_same(ref, ours, "logits")
    fg_hf._warned.clear()


@pytest.mark.parametrize("name, why", [("flashgen", "flash-attention package"), ("my_sdpa", "own implementations"),
                                       ("hub|fgen", "kernel-hub and paged")])
def test_register_rejects_reserved_names_saying_why(name, why):
    """register() refuses names transformers gives a meaning of its own, before registering
    anything, naming the part and the reason that applies to it."""
    with pytest.raises(ValueError, match=re.escape(f"name: {name!r}") + ".*" + why) as e:
        fg_hf.register(name)
    assert "choose another" in str(e.value)


def test_compiled_packed_call_takes_a_dropout_that_changes():
    """Under torch.compile a dropout probability that changes between calls becomes a symbolic
    float: the packed-sequence path guards on p > 0 (one graph for p 0, one for p > 0) instead of
    failing in fullgraph mode (the tiles of its block lists are a constant of the graph)."""
    cfg = transformers.LlamaConfig(vocab_size=100, num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128)
    mod = transformers.LlamaForCausalLM(cfg).model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g), \
        torch.randn(1, 2, 12, 16, generator=g)
    ids = torch.full((1, 12), -1, dtype=torch.int32)
    ids[:, 5:] = -2  # two packed sequences

    def f(q, k, v, m, p):
        return fg_hf.attention_forward(mod, q, k, v, m, dropout=p, scaling=0.25)[0]

    torch._dynamo.reset()
    try:
        cf = torch.compile(f, backend="aot_eager", fullgraph=True)
        outs = [cf(q, k, v, ids, p) for p in (0.0, 0.1, 0.2, 0.0)]
    finally:
        torch._dynamo.reset()
    assert all(torch.isfinite(o).all() for o in outs)
    torch.testing.assert_close(outs[0], outs[3], rtol=0, atol=0)  # p 0: deterministic
    assert not torch.equal(outs[0], outs[1])  # p 0.1 dropped something


def _pair(cfg, cls):
    """Two models of ``cls`` from copies of ``cfg`` with the same weights: eager and fgen."""
    import copy

    torch.manual_seed(0)
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    ref = make(copy.deepcopy(cfg), attn_implementation="eager").eval()
    torch.manual_seed(0)
    ours = make(copy.deepcopy(cfg), attn_implementation="fgen").eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("src_len, tgt_len", [(11, 7), (7, 11)])
def test_cross_attention_without_encoder_mask_sees_every_encoder_state(src_len, tgt_len):
    """Cross-attention with no encoder attention_mask attends to all encoder states, also when
    the decoder input is shorter than the encoder's (the mask function once cut the keys to the
    queries' count, as for a partly written static cache)."""
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0)
    ref, ours = _pair(cfg, transformers.BartForConditionalGeneration)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(3, VOCAB, (2, src_len), generator=g)
    tgt = torch.randint(3, VOCAB, (2, tgt_len), generator=g)
    before = Counter(fg_hf.call_counts)
    with torch.no_grad():
        want = ref(input_ids=src, decoder_input_ids=tgt).logits
        got = ours(input_ids=src, decoder_input_ids=tgt).logits
    assert sum((fg_hf.call_counts - before).values()) == 3  # encoder, decoder self- and cross-attention
    assert not any(k.startswith("fallback") for k in fg_hf.call_counts - before)
    assert_same(want, got, "BART logits without an encoder mask")
    pad = torch.ones_like(src)  # and with a padded source: the encoder mask's columns are its keys
    pad[0, :3] = 0
    pad[1, -2:] = 0
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=pad, decoder_input_ids=tgt).logits
        got = ours(input_ids=src, attention_mask=pad, decoder_input_ids=tgt).logits
    assert_same(want, got, "BART logits with a padded source")


@pytest.mark.parametrize("local", [6, 8])
def test_bidirectional_sliding_window_is_the_masks_window(local):
    """ModernBERT's local layers pass sliding_window = config.sliding_window + 1 (flash-attention's
    convention) while its mask keeps |q - kv| <= config.sliding_window: flashgen keeps the mask's
    window (logits and gradients equal eager's)."""
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64, local_attention=local,
                                        global_attn_every_n_layers=2, layer_types=["sliding_attention"],
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                        sep_token_id=2)
    ref, ours = _pair(cfg, transformers.ModernBertForMaskedLM)
    assert ours.model.layers[0].attn.sliding_window == cfg.sliding_window + 1  # the convention this tests
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    outs = []
    for m in (ref, ours):
        m.zero_grad()
        logits = m(ids).logits
        logits.square().mean().backward()
        outs.append((logits.detach(), m.model.layers[0].attn.Wqkv.weight.grad.clone()))
    assert_same(outs[0][0], outs[1][0], "ModernBERT logits")
    assert_same(outs[0][1], outs[1][1], "ModernBERT Wqkv gradient")


@pytest.mark.parametrize("kind", ["pegasus_x", "nllb_moe", "bigbird_pegasus"])
def test_models_outside_the_flash_contract_fall_back_with_eager_masks(kind):
    """Models whose layers do not follow flash-attention's 2-D mask contract get transformers'
    eager 4-D masks from the mask function, and their attention falls back with a warning naming
    the model: PegasusX (its decoder's self-attention says is_causal=False; causal only through
    the mask: once computed bidirectionally), NLLB-MoE (no flash-attention support declared, the
    same layers) and BigBirdPegasus (its own encoder attention adds the mask to 4-D scores: once a
    crash). Logits equal eager's, and the decoder sees no later token."""
    kw = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
              activation_dropout=0.0, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
              decoder_start_token_id=0)
    cfg = {"pegasus_x": lambda: transformers.PegasusXConfig(**kw, block_size=4, num_global_tokens=2),
           "nllb_moe": lambda: transformers.NllbMoeConfig(**kw, num_experts=4, expert_capacity=64),
           "bigbird_pegasus": lambda: transformers.BigBirdPegasusConfig(**kw, attention_type="original_full")}[kind]()
    ref, ours = _pair(cfg, transformers.AutoModelForSeq2SeqLM)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, VOCAB, (2, 9), generator=g)
    tgt = torch.randint(3, VOCAB, (2, 5), generator=g)
    later = tgt.clone()
    later[:, -1] = (later[:, -1] + 1) % VOCAB
    fg_hf._warned.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = ref(input_ids=src, decoder_input_ids=tgt).logits
        got = ours(input_ids=src, decoder_input_ids=tgt).logits
        moved = ours(input_ids=src, decoder_input_ids=later).logits
    assert_same(want, got, f"{kind} logits")
    assert torch.equal(got[:, 0], moved[:, 0])  # position 0 does not see the last decoder token
    name = type(ref.model).__name__.removesuffix("Model")
    assert any(name in str(w.message) and "2-D mask" in str(w.message) or "is_causal=False" in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def test_static_cache_mask_spanning_every_slot():
    """A 2-D mask as long as the static cache (ones for the tokens so far, zeros for empty slots)
    in chunked prefill: each chunk's queries see only the tokens before them, as with eager."""
    cfg = config("llama")
    ref, ours = _pair(cfg, transformers.LlamaForCausalLM)
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(2))
    caches = [transformers.StaticCache(config=m.config, max_cache_len=24) for m in (ref, ours)]
    pos = 0
    for n in (6, 4, 1, 3):
        mask = torch.zeros(2, 24, dtype=torch.long)
        mask[:, :pos + n] = 1
        kw = dict(input_ids=ids[:, pos:pos + n], position_ids=torch.arange(pos, pos + n)[None].expand(2, -1),
                  attention_mask=mask, use_cache=True)
        with torch.no_grad():
            want = ref(past_key_values=caches[0], **kw).logits
            got = ours(past_key_values=caches[1], **kw).logits
        assert_same(want, got, f"chunk of {n} at {pos}")
        pos += n


@pytest.mark.parametrize("kind", ["gemma_bidirectional", "falcon_alibi"])
def test_config_flags_outside_the_flash_contract_take_eager_masks(kind):
    """Gemma with use_bidirectional_attention=True (PaliGemma's text model: its layers declare
    is_causal=False, transformers' mask is causal on a padded batch: once computed both ways) and
    Falcon with alibi=True (it adds its bias to the 4-D mask itself: once wrong at batch 1 and a
    crash otherwise) get eager 4-D masks: logits equal eager's on a left-padded batch."""
    if kind == "gemma_bidirectional":
        cfg = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       use_bidirectional_attention=True)
        cls = transformers.GemmaForCausalLM
    else:
        cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        alibi=True, new_decoder_architecture=False, multi_query=True, bias=True)
        cls = transformers.FalconForCausalLM
    ref, ours = _pair(cfg, cls)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    fg_hf._warned.clear()
    for m in (None, mask):
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            want = ref(input_ids=ids, attention_mask=m).logits
            got = ours(input_ids=ids, attention_mask=m).logits
        keep = torch.ones_like(ids, dtype=torch.bool) if m is None else m.bool()
        assert_same(want[keep], got[keep], f"{kind} logits, mask {m is not None}")
        if m is None:  # the first call warns, naming the config's flag
            flag = "use_bidirectional_attention=True" if kind == "gemma_bidirectional" else "alibi=True"
            assert any(flag in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_fallback_warning_points_at_the_callers_line():
    """A fallback warning names the line of the user's code that called the model, not a line
    inside transformers, torch or flashgen."""
    m = model("llama")
    ids, mask = batch("none")
    m.eval()
    fg_hf._warned.clear()
    try:
        m.set_attn_implementation("fgen")
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            m(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        m.set_attn_implementation("eager")
        fg_hf._warned.clear()
    ours = [w for w in seen if "flashgen.integrations.transformers" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]
