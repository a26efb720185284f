"""A Gemma-2-style model through transformers, attention by flashgen ("fgen"), FlexAttention,
eager and (different math) SDPA: training tokens/s and decoding tokens/s (issue 21).

    python scripts/e2e_gemma2.py --out docs/e2e [--part train,generate]
        [--impls fgen,flex_attention,eager,sdpa] [--train-seqlens 4096,8192] [--batch-tokens 16384]
        [--steps 20] [--warmup 5] [--gen-batches 1,16,64] [--gen-contexts 4096,16384,32768]
        [--gen-steps 32] [--gen-warmup 4] [--layers 8] [--window 4096] [--softcap 50]
        [--vocab 32000] [--time-limit 570] [--tag NAME] [--smoke]

Model: transformers' Gemma2ForCausalLM from a Gemma2Config, random init: Gemma 2 2B's layer
shape (width 2304, MLP 9216, 8 query heads, 4 key/value heads: GQA, head dim 256,
query_pre_attn_scalar 256, attention soft-capping 50, final logit soft-capping 30, sliding
window 4096 on every other layer) with --layers layers (default 8) and a --vocab vocabulary
(default 32000, not Gemma's 256000, so that the embedding does not dominate). Inputs are random
token ids (--data-seed): throughput does not depend on them.

Implementations: fgen (flashgen), flex_attention (transformers' own), eager (transformers'
eager attention: the reference math), and sdpa: transformers' Gemma 2 refuses SDPA, which has
no soft-capping, so it is registered under another name as transformers' own
sdpa_attention_forward and mask with the softcap argument dropped; it computes different math
(no soft-capping) and is labelled so.

Training (--part train): AdamW, fp32 weights under bf16 autocast on CUDA, ``torch.compile`` of
the model (--no-compile: none); micro-batch ``--batch-tokens // seqlen``; tokens/s over --steps
steps after --warmup steps, between ``torch.cuda.synchronize`` calls; peak memory by
``torch.cuda.max_memory_allocated``.

Generation (--part generate): bf16 weights, transformers' StaticCache of ``context +
gen-warmup + gen-steps`` slots (sliding layers keep their window), filled with random keys and
values up to ``context`` (decoding time does not depend on their values; no prefill is timed
or run), then greedy one-token steps of the ``torch.compile``d model at batch sizes
--gen-batches; tokens/s = batch * gen-steps / time of the gen-steps steps after gen-warmup
steps. Filling the cache sets its layers' lengths (``cumulative_length``; transformers 5.x):
with a StaticCache without them the script stops and says so. A cell whose cache would not fit
in the GPU's free memory is skipped and recorded as such.

A measurement that does not fit in what is left of --time-limit is skipped and recorded as
skipped; one out of memory as "oom". Writes ``<out>/gemma2-<tag>.json`` and
``gemma2-<tag>-train.png`` / ``-generate.png``; prints tables. Exit status 1 when a measurement
failed (its error is in the JSON), 2 for a missing prerequisite. A status that says "recompiled
inside the timed steps" marks a figure that includes compilation time.

flashgen's kernels are built (or loaded from flashgen's cache) before any timing, the seconds
recorded as fgen_build_s; a cold build counts against --time-limit, so build them first:
``python -c "import flashgen.integrations.transformers as f; f.build('cuda', ['bf16'], [256])"``.

Every compiled (impl, shape) compiles afresh, so one H200 run of the default grid does not fit
10 minutes: split it, e.g. ``--part train``, then ``--part generate --gen-contexts 4096``, and so
on per context.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_common as common

IMPLS = ("fgen", "flex_attention", "eager", "sdpa")
LABELS = {"fgen": "fgen", "flex_attention": "flex_attention", "eager": "eager",
          "sdpa": "sdpa (no softcap: different math)"}


def attn_name(impl: str) -> str:
    return common.SDPA_NOCAP if impl == "sdpa" else impl


def gemma_config(args, max_positions: int):
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                        query_pre_attn_scalar=args.head_dim, sliding_window=args.window,
                        attn_logit_softcapping=args.softcap, final_logit_softcapping=30.0,
                        max_position_embeddings=max_positions, attention_dropout=0.0,
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(args.layers)],
                        pad_token_id=0, bos_token_id=2, eos_token_id=1)


def new_model(args, max_positions: int, device, dtype=None):
    from transformers import Gemma2ForCausalLM

    torch.manual_seed(args.seed)
    model = Gemma2ForCausalLM(gemma_config(args, max_positions))
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


def status_of(complete: bool, frames_before: int) -> str:
    status = "ok" if complete else "truncated (time limit)"
    if common.compiled_frames() > frames_before:
        status += "; recompiled inside the timed steps"
    return status


# --- training ------------------------------------------------------------------------------------

def train_run(args, impl: str, seqlen: int, device, budget: common.Budget) -> dict:
    batch = args.batch_tokens // seqlen
    steps = args.warmup + args.steps
    common.reset_memory(device)
    common.dynamo_reset()
    model = new_model(args, seqlen, device)
    model.set_attn_implementation(attn_name(impl))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    fwd = torch.compile(model, mode=args.compile_mode, backend=args.compile_backend) if not args.no_compile else model
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    g = torch.Generator().manual_seed(args.data_seed)
    ids = torch.randint(3, args.vocab, (steps, batch, seqlen), generator=g).to(device)
    losses = []
    calls_before = common.fgen_calls()

    graphs = not args.no_compile and common.cuda_graphs(args.compile_mode)

    def step(i):
        if graphs:  # a new step: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            out = fwd(input_ids=ids[i], labels=ids[i], use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float().clone())  # a copy: a graph's output is overwritten by its next run

    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    common.sync(device)
    t1 = time.perf_counter()
    frames = common.compiled_frames()
    done = args.warmup
    for i in range(args.warmup, steps):
        step(i)
        done = i + 1
        if budget.left() < 5:
            break
    common.sync(device)
    t2 = time.perf_counter()
    timed = done - args.warmup
    res = {"status": status_of(done == steps, frames), "batch": batch,
           "params": sum(p.numel() for p in model.parameters()), "timed_steps": timed,
           "tokens_per_s": timed * batch * seqlen / (t2 - t1) if timed else None, "warmup_s": t1 - t0,
           "timed_s": t2 - t1, "peak_memory_gib": common.peak_memory_gib(device),
           "graph_breaks": None if args.no_compile else common.graph_breaks(),
           "graph_break_reasons": None if args.no_compile else common.graph_break_reasons(),
           "losses": torch.stack(losses).cpu().tolist()}
    if impl == "fgen":
        res["fgen_calls"] = {k: v - calls_before.get(k, 0) for k, v in common.fgen_calls().items()
                             if v != calls_before.get(k, 0)}
    if args.profile_steps and done == steps:  # after the timed steps: the figures above are untouched
        res["profile"] = common.kernel_profile(lambda k: step(k % steps), args.profile_steps, device, top=25)
        common.print_profile(f"{impl} {seqlen}", res["profile"])
    return res


# --- generation ----------------------------------------------------------------------------------

def cache_bytes(args, batch: int, slots: int, elem: int) -> int:
    full = sum(1 for i in range(args.layers) if i % 2 == 1)
    sliding = args.layers - full
    per_slot = batch * args.kv_heads * args.head_dim * 2 * elem  # keys and values
    return per_slot * (full * slots + sliding * min(slots, args.window))


def static_cache(model, batch: int, slots: int, context: int, dtype, device):
    """A StaticCache of ``slots`` slots holding ``context`` random tokens' keys and values."""
    import transformers
    from transformers import StaticCache

    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=slots)
    cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(1234)  # the same contents for every implementation
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length") or not hasattr(layer, "keys"):
            raise common.MissingPiece(f"transformers {transformers.__version__}: its StaticCache layers "
                                      f"({type(layer).__name__}) have no cumulative_length / keys, which this "
                                      "script sets to fill the cache (written against transformers 5.24)")
        layer.keys.normal_(0, 1, generator=g)
        layer.values.normal_(0, 1, generator=g)
    set_length(cache, context)
    return cache


def set_length(cache, n: int) -> None:
    """The cache's layers now hold ``n`` tokens (sliding layers: the last of them)."""
    for layer in cache.layers:
        if hasattr(layer, "cumulative_length_int"):  # sliding
            layer.cumulative_length_int = n
        layer.cumulative_length.fill_(min(n, layer.max_cache_len))


def generate_run(args, model, impl: str, batch: int, context: int, device, dtype, budget) -> dict:
    slots = context + args.gen_warmup + args.gen_steps
    common.reset_memory(device)
    common.dynamo_reset()
    model.set_attn_implementation(attn_name(impl))
    cache = static_cache(model, batch, slots, context, dtype, device)
    tok = torch.randint(3, args.vocab, (batch, 1), generator=torch.Generator().manual_seed(args.data_seed)).to(device)
    pos = torch.full((batch, 1), context, dtype=torch.long, device=device)
    # the cache's argument: "cache" in newer transformers, "past_key_values" in 5.17 (where "cache"
    # lands unused in **kwargs and every step would run on a fresh, empty cache)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def decode(tok, pos):
        logits = model(input_ids=tok, position_ids=pos, **{key: cache}, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1:].argmax(-1)

    fn = torch.compile(decode, mode=args.gen_compile_mode, backend=args.compile_backend) if not args.no_compile else decode
    if not args.no_compile and common.cuda_graphs(args.gen_compile_mode):
        graphed = fn

        def fn(tok, pos):  # each step marked, its token copied out of the graph's output buffer
            torch.compiler.cudagraph_mark_step_begin()
            return graphed(tok, pos).clone()
    calls_before = common.fgen_calls()
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(args.gen_warmup):
            tok = fn(tok, pos)
            pos.add_(1)
        common.sync(device)
        t1 = time.perf_counter()
        frames = common.compiled_frames()
        done = 0
        out = []
        for _ in range(args.gen_steps):
            tok = fn(tok, pos)
            out.append(tok)
            pos.add_(1)
            done += 1
            if budget.left() < 5:
                break
        common.sync(device)
        t2 = time.perf_counter()
    res = {"status": status_of(done == args.gen_steps, frames), "timed_steps": done,
           "tokens_per_s": batch * done / (t2 - t1) if done else None, "ms_per_step": (t2 - t1) / done * 1e3,
           "warmup_s": t1 - t0, "cache_gib": cache_bytes(args, batch, slots, dtype.itemsize) / 2**30,
           "peak_memory_gib": common.peak_memory_gib(device),
           "graph_breaks": None if args.no_compile else common.graph_breaks(),
           "graph_break_reasons": None if args.no_compile else common.graph_break_reasons(),
           "tokens_row0": torch.cat(out, 1)[0].tolist() if out else []}
    if impl == "fgen":
        res["fgen_calls"] = {k: v - calls_before.get(k, 0) for k, v in common.fgen_calls().items()
                             if v != calls_before.get(k, 0)}
    return res


# --- the command ---------------------------------------------------------------------------------

def ints(text: str, what: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"error: {what}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"error: {what}: expected positive integers, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tag", default=None, help="file name part (default: the parts and lengths)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    ap.add_argument("--part", default="train,generate", help="train and/or generate")
    ap.add_argument("--impls", default=None, help="comma-separated among " + ", ".join(IMPLS)
                    + " (default all; --smoke: fgen,eager,sdpa)")
    ap.add_argument("--train-seqlens", default=None, help="default 4096,8192")
    ap.add_argument("--batch-tokens", type=int, default=None, help="training tokens per step (default 16384)")
    ap.add_argument("--steps", type=int, default=None, help="timed training steps (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed training steps first (default 5)")
    ap.add_argument("--gen-batches", default=None, help="default 1,16,64")
    ap.add_argument("--gen-contexts", default=None, help="tokens in the cache before decoding (default 4096,16384,32768)")
    ap.add_argument("--gen-steps", type=int, default=None, help="timed decoding steps (default 32)")
    ap.add_argument("--gen-warmup", type=int, default=None, help="untimed decoding steps first (default 4)")
    ap.add_argument("--layers", type=int, default=None, help="default 8")
    ap.add_argument("--window", type=int, default=None, help="sliding window of every other layer (default 4096)")
    ap.add_argument("--softcap", type=float, default=50.0, help="attention logit soft-capping")
    ap.add_argument("--vocab", type=int, default=None, help="default 32000")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode for training (default torch's)")
    ap.add_argument("--gen-compile-mode", default=None, help="torch.compile mode for decoding (default torch's; "
                    "'reduce-overhead' adds CUDA graphs, but transformers' static sliding-window cache "
                         "counts tokens in a Python int, so a graph is recorded per step)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (default inductor; 'eager' traces with dynamo only: a cheap check)")
    ap.add_argument("--no-compile", action="store_true", help="run everything uncompiled")
    ap.add_argument("--compile-smoke", action="store_true",
                    help="with --smoke: compile too (with --compile-backend, default 'eager': dynamo only)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 with --smoke)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after a training run's timed steps, this many more under torch.profiler: the top kernels "
                         "by device time per step go into the JSON ('profile') and are printed (a diagnostic)")
    ap.add_argument("--time-limit", type=float, default=570.0, help="seconds; later measurements are skipped past it")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model (2 layers, width 64, head dim 16, window 8), CPU, fp32, 2 steps, no compile "
                         "(unless --compile-smoke): "
                         "a check that the script runs, not a measurement")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="redraw the table and plots of a gemma2-TAG.json this script wrote (into --out), run nothing")
    args = ap.parse_args(argv)
    if args.replot is not None:
        return common.replot(args.replot, args.out, "gemma2", finish)

    smoke = args.smoke
    defaults = {"device": "cpu" if smoke else "cuda", "impls": "fgen,eager,sdpa" if smoke else ",".join(IMPLS),
                "train_seqlens": "16,32" if smoke else "4096,8192", "batch_tokens": 64 if smoke else 16384,
                "steps": 2 if smoke else 20, "warmup": 1 if smoke else 5, "gen_batches": "1,2" if smoke else "1,16,64",
                "gen_contexts": "12" if smoke else "4096,16384,32768", "gen_steps": 2 if smoke else 32,
                # a compiled smoke warms up twice: transformers' sliding-window static cache keeps its length
                # as a Python int, which dynamo specialises at the first step and makes dynamic at the second
                "gen_warmup": (2 if args.compile_smoke else 1) if smoke else 4,
                "layers": 2 if smoke else 8, "window": 8 if smoke else 4096,
                "vocab": 128 if smoke else 32000, "threads": 1 if smoke else None}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if smoke:
        args.hidden, args.mlp, args.heads, args.kv_heads, args.head_dim = 64, 128, 4, 2, 16
        if args.compile_backend == "inductor":
            args.compile_backend = "eager"  # dynamo's tracing only (inductor's CPU build takes minutes)
        args.no_compile = not args.compile_smoke
    else:
        args.hidden, args.mlp, args.heads, args.kv_heads, args.head_dim = 2304, 9216, 8, 4, 256
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    if not parts or set(parts) - {"train", "generate"}:
        raise SystemExit(f"error: --part: expected train and/or generate, got {args.part!r}")
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise SystemExit(f"error: --impls: unknown implementation {bad[0] if bad else args.impls!r} "
                         f"(expected some of {', '.join(IMPLS)})")
    seqlens = ints(args.train_seqlens, "--train-seqlens")
    batches, contexts = ints(args.gen_batches, "--gen-batches"), ints(args.gen_contexts, "--gen-contexts")
    for what, v in (("--steps", args.steps), ("--gen-steps", args.gen_steps), ("--layers", args.layers),
                    ("--window", args.window), ("--vocab", args.vocab)):
        if v < 1:
            raise SystemExit(f"error: {what}: expected >= 1, got {v}")
    if not 0 <= args.profile_steps <= args.steps:
        raise SystemExit(f"error: --profile-steps: expected 0 to --steps ({args.steps}), got {args.profile_steps}")
    if args.batch_tokens < max(seqlens):
        raise SystemExit(f"error: --batch-tokens {args.batch_tokens} is less than --train-seqlens {max(seqlens)}")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads: expected >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    tag = args.tag or ("smoke" if smoke else "-".join(
        (["train"] if "train" in parts else []) + (["gen" + "-".join(map(str, contexts))] if "generate" in parts
                                                   else [])))

    common.require_transformers()
    plt = common.require_matplotlib()
    device = common.check_device(args.device)
    budget = common.Budget(args.time_limit)
    common.register_backends()
    gen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"what": "Gemma-2-style model through transformers (scripts/e2e_gemma2.py)", "smoke": smoke,
              "environment": common.environment(device),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "model": {"layers": args.layers, "hidden": args.hidden, "mlp": args.mlp, "heads": args.heads,
                        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "window": args.window,
                        "softcap": args.softcap, "final_softcap": 30.0, "vocab": args.vocab},
              "labels": LABELS, "train": [], "generate": []}
    path = args.out / f"gemma2-{tag}.json"
    if "fgen" in impls:
        report["fgen_build_s"] = common.build_fgen(device, gen_dtype, args.head_dim)
    failed = False

    def measure(kind: str, rec: dict, fn, estimate: float) -> None:
        nonlocal failed
        if not budget.fits(estimate):
            rec["status"] = f"skipped: about {estimate:.0f} s needed, {budget.left():.0f} s left of --time-limit"
        else:
            try:
                with common.FgenWarnings() as caught:
                    rec.update(fn())
                if caught.messages:
                    rec["warnings"] = caught.messages
                note = common.fgen_note(rec.get("fgen_calls", {}), rec.get("warnings"))
                if note:
                    rec["status"] += "; " + note
            except common.MissingPiece:
                raise
            except Exception as e:  # noqa: BLE001 (recorded; the other measurements go on)
                if common.is_oom(e):
                    rec["status"] = "oom"
                else:
                    failed = True
                    rec["status"], rec["error"] = "error", f"{type(e).__name__}: {e}"
                    traceback.print_exc()
            common.reset_memory(device)  # after the except clause: its traceback no longer holds the run
            common.dynamo_reset()
        report[kind].append(rec)
        report["elapsed_s"] = budget.elapsed()
        common.write_json(path, report)
        tps = rec.get("tokens_per_s")
        print(f"{kind} {rec['label']:>34} {rec.get('seqlen') or (rec['batch'], rec['context'])}: {rec['status']}"
              + (f", {tps:,.0f} tokens/s" if tps else ""), flush=True)

    if "train" in parts:
        spent = 0.0
        for seqlen in seqlens:
            for impl in impls:
                t0 = time.perf_counter()
                measure("train", {"impl": impl, "label": LABELS[impl], "seqlen": seqlen,
                                  "batch": args.batch_tokens // seqlen},
                        lambda impl=impl, seqlen=seqlen: train_run(args, impl, seqlen, device, budget),
                        spent * seqlen / seqlens[0])
                spent = max(spent, (time.perf_counter() - t0) * seqlens[0] / seqlen)
    if "generate" in parts:
        common.reset_memory(device)
        model = new_model(args, max(contexts) + args.gen_warmup + args.gen_steps + 1, device, gen_dtype).eval()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        spent = 0.0
        for context in contexts:
            for batch in batches:
                need = cache_bytes(args, batch, context + args.gen_warmup + args.gen_steps, gen_dtype.itemsize)
                for impl in impls:
                    rec = {"impl": impl, "label": LABELS[impl], "batch": batch, "context": context}
                    if device.type == "cuda":
                        common.reset_memory(device)  # the previous cell's cache goes back first
                        free, _ = torch.cuda.mem_get_info(device)
                        if need > 0.85 * free:
                            rec["status"] = (f"skipped: the cache needs {need / 2**30:.1f} GiB, "
                                             f"{free / 2**30:.1f} GiB free besides {weights / 2**30:.1f} GiB of weights")
                            report["generate"].append(rec)
                            continue
                    t0 = time.perf_counter()
                    measure("generate", rec, lambda impl=impl, batch=batch, context=context: generate_run(
                        args, model, impl, batch, context, device, gen_dtype, budget), spent)
                    spent = max(spent, time.perf_counter() - t0)
        del model

    finish(report, args.out, tag, plt)
    common.write_json(path, report)
    print(f"wrote {path}")
    return 1 if failed else 0


def finish(report: dict, out: Path, tag: str, plt) -> None:
    gpu = report["environment"].get("gpu") or "CPU"
    m = report["model"]
    title = (f"Gemma-2-style, {m['layers']} layers, GQA {m['heads']}/{m['kv_heads']}, d {m['head_dim']}, "
             f"window {m['window']}, softcap {m['softcap']:g}; {gpu}")
    note = "(--smoke: a tiny model on the CPU; these figures measure nothing)" if report["smoke"] else ""
    if report["train"]:
        rows = report["train"]
        for r in rows:
            ref = next((x.get("tokens_per_s") for x in rows if x["impl"] == "flex_attention"
                        and x["seqlen"] == r["seqlen"]), None)
            r["vs_flex"] = r["tokens_per_s"] / ref if r.get("tokens_per_s") and ref else None
        print(common.table(rows, [("label", "impl"), ("seqlen", "seqlen"), ("batch", "batch"), ("status", "status"),
                                  ("tokens_per_s", "train tokens/s"), ("vs_flex", "× flex_attention"),
                                  ("peak_memory_gib", "peak GiB"), ("graph_breaks", "graph breaks")]))
        seqlens = sorted({r["seqlen"] for r in rows})
        labels = list(dict.fromkeys(r["label"] for r in rows))
        common.bar_plot(plt, out / f"gemma2-{tag}-train.png", [f"seqlen {s}" for s in seqlens],
                        {lab: [next((r.get("tokens_per_s") for r in rows if r["label"] == lab and r["seqlen"] == s),
                                    None) for s in seqlens] for lab in labels},
                        "training tokens/s", "training, " + title)
    if report["generate"]:
        rows = report["generate"]
        for r in rows:
            ref = next((x.get("tokens_per_s") for x in rows if x["impl"] == "eager"
                        and (x["batch"], x["context"]) == (r["batch"], r["context"])), None)
            r["vs_eager"] = r["tokens_per_s"] / ref if r.get("tokens_per_s") and ref else None
            eager = next((x.get("tokens_row0") for x in rows if x["impl"] == "eager"
                          and (x["batch"], x["context"]) == (r["batch"], r["context"])), None)
            # information only: greedy tokens from the same cache; bf16 rounding may flip near-ties
            r["same_tokens_as_eager"] = r["tokens_row0"] == eager if r.get("tokens_row0") and eager else None
        print(common.table(rows, [("label", "impl"), ("batch", "batch"), ("context", "context"), ("status", "status"),
                                  ("tokens_per_s", "decode tokens/s"), ("vs_eager", "× eager"),
                                  ("ms_per_step", "ms/step"), ("cache_gib", "cache GiB"),
                                  ("same_tokens_as_eager", "eager's tokens"),
                                  ("graph_breaks", "graph breaks")]))
        cells = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
        labels = list(dict.fromkeys(r["label"] for r in rows))
        common.bar_plot(plt, out / f"gemma2-{tag}-generate.png", [f"B {b}, ctx {c}" for b, c in cells],
                        {lab: [next((r.get("tokens_per_s") for r in rows if r["label"] == lab
                                     and (r["batch"], r["context"]) == cell), None) for cell in cells]
                         for lab in labels},
                        "decoding tokens/s", "static-cache decoding, " + title)
    if note:
        print(note)


if __name__ == "__main__":
    sys.exit(main())
