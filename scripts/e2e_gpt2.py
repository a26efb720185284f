"""GPT-2 small trained from scratch through transformers, attention by flashgen ("fgen"), SDPA,
FlexAttention and eager: tokens/s, peak memory and loss curves (issue 21).

    python scripts/e2e_gpt2.py --out docs/e2e [--seqlens 1024,4096]
        [--runs fgen,sdpa,flex_attention,eager,eager:nocompile] [--curve fgen:0,sdpa:0,sdpa:1]
        [--steps 30] [--warmup 10] [--curve-steps 300] [--curve-seqlen 1024] [--batch-tokens 16384]
        [--tokenizer auto|bpe|bytes] [--vocab 50257] [--time-limit 570] [--tag NAME] [--smoke]

Model: transformers' GPT2LMHeadModel from a GPT2Config (12 layers, 12 heads, width 768: GPT-2
small; with GPT-2's vocabulary of 50257, 124M parameters at n_positions 1024), random init,
dropout 0 unless --dropout, n_positions = the sequence length, the embedding rows padded to a
multiple of 64. Its parameter count (with the tokenizer's vocabulary) is recorded. Training: AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1), linear warm-up over
the first 10% of the steps then cosine to 10%, gradient clipping 1.0, fp32 weights under bf16
autocast on CUDA (fp32 on the CPU).

Corpus: the .py files of this Python's standard library (``sysconfig.get_paths()['stdlib']``,
site-packages left out), sorted by path and joined with an end-of-text token; every 100th file
is held out for the validation loss. Tokenizer: a byte-level BPE trained on the training files
with the ``tokenizers`` package (``--vocab`` entries including the special token), or, without
the package or with ``--tokenizer bytes``, bytes (vocabulary 257: 256 bytes + end-of-text).
The tokenized corpus (and the BPE) is cached under --data-cache (default
``$XDG_CACHE_HOME/flashgen-e2e``, else ``~/.cache/flashgen-e2e``), keyed by the files' contents. Batches are random windows drawn with
``--data-seed``, the same for every run; a run's seed sets the model's initialisation.

Runs: ``impl`` (under ``torch.compile``) or ``impl:nocompile``, impl one of fgen, sdpa,
flex_attention (transformers' GPT-2 declares no flex support, so it is registered under another
name with transformers' own flex_attention_forward and mask), eager; each at every --seqlens
with micro-batch ``--batch-tokens // seqlen`` (fixed per sequence length). tokens/s: the
--steps steps after --warmup warm-up steps (compilation happens there), timed with
``time.perf_counter`` between ``torch.cuda.synchronize`` calls; no host sync inside the window
(losses stay on the device). Peak memory: ``torch.cuda.max_memory_allocated`` over the run.
Loss curves: the --curve runs (``impl:seed``, compiled, at --curve-seqlen) train --curve-steps
steps; their tokens/s replaces the seed-0 run's of the same impl. A run that does not fit in
what is left of --time-limit is skipped and recorded as such; one out of memory as "oom".

Writes ``<out>/gpt2-<tag>.json`` (environment, settings, every run's result and loss curve)
and ``gpt2-<tag>-tokens.png``, ``-memory.png``, ``-loss.png``; prints a table. Exit status 1
when a run failed (its error is in the JSON), 2 for a missing prerequisite. A status that says
"recompiled inside the timed steps" marks a figure that includes compilation time.

flashgen's kernels are built (or loaded from flashgen's cache) before any timing, the seconds
recorded as fgen_build_s; a cold build counts against --time-limit, so build them first:
``python -c "import flashgen.integrations.transformers as f; f.build('cuda', ['bf16'], [64])"``.

One H200 run of the defaults does not fit 10 minutes; split it, e.g. ``--seqlens 1024`` (with the
loss curves) then ``--seqlens 4096 --curve none``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import sysconfig
import textwrap
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_common as common

IMPLS = ("fgen", "sdpa", "flex_attention", "eager")
EOT = "<|endoftext|>"


# --- corpus and tokenizer ------------------------------------------------------------------------

def stdlib_files(limit: int | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise common.MissingPiece(f"the standard library's sources are not at {root} (sysconfig 'stdlib')")
    if limit:  # the top folder's modules only (a walk of the whole library takes seconds)
        files = sorted(p for p in root.glob("*.py") if p.is_file())
    else:
        files = sorted(p for p in root.rglob("*.py")
                       if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file())
    if not files:
        raise common.MissingPiece(f"no .py files under {root}: this Python ships without its library's sources")
    return files[:limit] if limit else files


def corpus(limit: int | None = None, val_every: int = 100) -> tuple[list[str], list[str], str]:
    """(training texts, validation texts: every ``val_every``-th file, a digest of both)."""
    train, val = [], []
    digest = hashlib.sha256()
    for i, path in enumerate(stdlib_files(limit)):
        text = path.read_bytes().decode("utf-8", errors="replace")
        digest.update(text.encode())
        (val if i % val_every == val_every - 1 else train).append(text)
    return train, val, digest.hexdigest()[:16]


def pick_tokenizer(choice: str) -> str:
    if choice == "bytes":
        return "bytes"
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        if choice == "bpe":
            raise common.MissingPiece("--tokenizer bpe: the tokenizers package is not installed "
                                      "(pip install tokenizers, or --tokenizer bytes)")
        return "bytes"
    return "bpe"


def tokenize(texts_train, texts_val, kind: str, vocab: int, cache: Path, digest: str):
    """(train ids, val ids, vocabulary size, seconds spent) as int32 tensors; cached by content."""
    key = f"{kind}-{vocab if kind == 'bpe' else 257}-{digest}"
    path = cache / f"corpus-{key}.pt"
    if path.exists():
        d = torch.load(path)
        return d["train"], d["val"], d["vocab"], 0.0
    t0 = time.perf_counter()
    if kind == "bytes":
        def enc(texts):
            out = bytearray()
            for t in texts:
                out += t.encode("utf-8") + b"\x00"
            ids = torch.tensor(list(out), dtype=torch.int32) if len(out) < 4096 else \
                torch.frombuffer(out, dtype=torch.uint8).to(torch.int32)
            ids[ids == 0] = 256  # end-of-text (no NUL in source files)
            return ids
        train, val, size = enc(texts_train), enc(texts_val), 257
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts_train, trainer=trainer)
        eot = tok.token_to_id(EOT)

        def enc(texts):
            ids = []
            for e in tok.encode_batch(texts):
                ids.extend(e.ids)
                ids.append(eot)
            return torch.tensor(ids, dtype=torch.int32)
        train, val, size = enc(texts_train), enc(texts_val), tok.get_vocab_size()
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(cache / f"tokenizer-{key}.json"))
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "val": val, "vocab": size}, path)
    return train, val, size, time.perf_counter() - t0


# --- model and training --------------------------------------------------------------------------

def gpt2_config(args, vocab: int, seqlen: int):
    from transformers import GPT2Config

    padded = -(-vocab // 64) * 64
    p = args.dropout
    return GPT2Config(vocab_size=padded, n_positions=seqlen, n_embd=args.width, n_layer=args.layers,
                      n_head=args.heads, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=vocab - 1,
                      eos_token_id=vocab - 1, use_cache=False)


def attn_name(impl: str) -> str:
    return common.TORCH_FLEX if impl == "flex_attention" else impl


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 10)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_run(args, run: dict, data: dict, device: torch.device, budget: common.Budget) -> dict:
    """One training run; returns its result (tokens/s, memory, losses) or raises."""
    from transformers import GPT2LMHeadModel

    seqlen, batch, steps = run["seqlen"], run["batch"], run["steps"]
    common.reset_memory(device)
    common.dynamo_reset()
    torch.manual_seed(run["seed"])
    model = GPT2LMHeadModel(gpt2_config(args, data["vocab"], seqlen)).to(device)
    model.set_attn_implementation(attn_name(run["impl"]))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    fwd = torch.compile(model, mode=args.compile_mode, backend=args.compile_backend) if run["compiled"] else model
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                  enabled=False)
    train = data["train"]
    g = torch.Generator().manual_seed(args.data_seed)
    starts = torch.randint(0, train.numel() - seqlen, (steps, batch), generator=g).to(device)
    offs = torch.arange(seqlen, device=device)
    losses = []
    calls_before = common.fgen_calls()

    graphs = run["compiled"] and common.cuda_graphs(args.compile_mode)

    def step(i: int):
        if graphs:  # a new step: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        for group in opt.param_groups:
            group["lr"] = lr_at(i, steps, args.lr)
        window = train[starts[i][:, None] + offs]  # [batch, seqlen]
        with amp:  # the model shifts the labels: its loss covers seqlen - 1 positions of each row
            out = fwd(input_ids=window, labels=window, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float().clone())  # a copy: a graph's output is overwritten by its next run

    t0 = time.perf_counter()
    warm = min(args.warmup, steps - 1)
    for i in range(warm):
        step(i)
    common.sync(device)
    t1 = time.perf_counter()
    frames = common.compiled_frames()
    done = warm
    for i in range(warm, steps):
        step(i)
        done = i + 1
        if budget.left() < 5:  # host time runs ahead of the device: a rough stop, recorded
            break
    common.sync(device)
    t2 = time.perf_counter()
    timed = done - warm
    status = "ok" if done == steps else "truncated (time limit)"
    if common.compiled_frames() > frames:
        status += "; recompiled inside the timed steps"
    result = {
        "status": status,
        "params": params, "steps_done": done, "timed_steps": timed,
        "tokens_per_s": timed * batch * seqlen / (t2 - t1) if timed else None,
        "warmup_s": t1 - t0, "timed_s": t2 - t1,
        "peak_memory_gib": common.peak_memory_gib(device),
        "graph_breaks": common.graph_breaks() if run["compiled"] else None,
        "graph_break_reasons": common.graph_break_reasons() if run["compiled"] else None,
        "losses": torch.stack(losses).cpu().tolist(),
    }
    calls = {k: v - calls_before.get(k, 0) for k, v in common.fgen_calls().items() if v != calls_before.get(k, 0)}
    if run["impl"] == "fgen":
        result["fgen_calls"] = calls  # kernel calls by spec, and fallbacks
    if run.get("curve") and data["val"].numel() > seqlen:
        result["val_loss"] = val_loss(model, data["val"], seqlen, batch, device, amp)
    if args.profile_steps and done == steps:  # after the losses and the validation loss: these steps train on
        result["profile"] = common.kernel_profile(step, args.profile_steps, device)
        common.print_profile(label(run), result["profile"])
    return result


@torch.no_grad()
def val_loss(model, val, seqlen, batch, device, amp, batches: int = 4) -> float:
    """Mean loss of ``batches`` fixed windows of the held-out files (the uncompiled model)."""
    model.eval()
    g = torch.Generator().manual_seed(12345)
    offs = torch.arange(seqlen, device=device)
    total = []
    for _ in range(batches):
        starts = torch.randint(0, val.numel() - seqlen, (batch,), generator=g).to(device)
        w = val[starts[:, None] + offs]
        with amp:
            total.append(model(input_ids=w, labels=w).loss.float())
    model.train()
    return torch.stack(total).mean().item()


# --- the command ---------------------------------------------------------------------------------

def parse_runs(text: str, what: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        impl, _, tail = item.partition(":")
        if impl not in IMPLS:
            raise SystemExit(f"error: {what}: unknown implementation {impl!r} in {item!r} (expected one of "
                             f"{', '.join(IMPLS)})")
        out.append((impl, tail))
    return out


def plan(args) -> list[dict]:
    runs = []
    curve = [] if args.curve == "none" else parse_runs(args.curve, "--curve")
    curve_keys = set()
    for impl, seed in curve:
        if not seed.isdigit():
            raise SystemExit(f"error: --curve: expected impl:seed (e.g. sdpa:1), got {impl}:{seed}")
        curve_keys.add((impl, int(seed)))
    for seqlen in args.seqlens:
        batch = args.batch_tokens // seqlen
        if batch < 1:
            raise SystemExit(f"error: --batch-tokens {args.batch_tokens} is less than sequence length {seqlen}")
        for impl, tail in parse_runs(args.runs, "--runs"):
            if tail not in ("", "nocompile"):
                raise SystemExit(f"error: --runs: expected impl or impl:nocompile, got {impl}:{tail}")
            compiled = tail == "" and not args.no_compile
            is_curve = compiled == (not args.no_compile) and seqlen == args.curve_seqlen and (impl, 0) in curve_keys
            runs.append({"impl": impl, "compiled": compiled, "seqlen": seqlen, "batch": batch, "seed": 0,
                         "curve": is_curve, "steps": args.curve_steps if is_curve else args.warmup + args.steps})
    for impl, seed in sorted(curve_keys):
        have = any(r["impl"] == impl and r["seed"] == seed and r["curve"] for r in runs)
        if not have:
            runs.append({"impl": impl, "compiled": not args.no_compile, "seqlen": args.curve_seqlen,
                         "batch": args.batch_tokens // args.curve_seqlen, "seed": seed, "curve": True,
                         "steps": args.curve_steps})
    return runs


def label(r: dict) -> str:
    s = r["impl"] + ("" if r["compiled"] else " (no compile)")
    return s + (f" seed {r['seed']}" if r["seed"] else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True, type=Path, help="folder for the JSON and the PNGs")
    ap.add_argument("--data-cache", type=Path, default=None,
                    help="folder for the tokenized corpus (default $XDG_CACHE_HOME/flashgen-e2e or ~/.cache/flashgen-e2e)")
    ap.add_argument("--tag", default=None, help="file name part (default: the sequence lengths)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    ap.add_argument("--seqlens", default=None, help="comma-separated (default 1024,4096)")
    ap.add_argument("--runs", default=None,
                    help="comma-separated impl or impl:nocompile (default fgen,sdpa,flex_attention,eager,eager:nocompile)")
    ap.add_argument("--curve", default=None, help="loss-curve runs impl:seed, or 'none' (default fgen:0,sdpa:0,sdpa:1)")
    ap.add_argument("--curve-seqlen", type=int, default=None, help="default the first of --seqlens")
    ap.add_argument("--curve-steps", type=int, default=None, help="default 300")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 30)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 16384)")
    ap.add_argument("--tokenizer", choices=("auto", "bpe", "bytes"), default="auto",
                    help="auto: BPE when the tokenizers package is installed, else bytes")
    ap.add_argument("--vocab", type=int, default=50257,
                    help="BPE vocabulary size, special token included (default GPT-2's: the 124M model)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode (default: torch's default; reduce-overhead / max-autotune: CUDA graphs, "
                         "each step marked with torch.compiler.cudagraph_mark_step_begin)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (default inductor; 'eager' traces with dynamo only: a cheap check)")
    ap.add_argument("--no-compile", action="store_true", help="run everything uncompiled")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 with --smoke: tiny CPU ops only lose to thread contention)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after a run's timed steps, this many more under torch.profiler: the top kernels by "
                         "device time per step go into the JSON ('profile') and are printed (a diagnostic)")
    ap.add_argument("--time-limit", type=float, default=570.0, help="seconds; later runs are skipped past it")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model (2 layers, width 32), bytes, a few files, 3 steps, CPU, no compile: a check "
                         "that the script runs, not a measurement")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="redraw the table and plots of a gpt2-TAG.json this script wrote (into --out), run nothing")
    args = ap.parse_args(argv)
    if args.replot is not None:
        return common.replot(args.replot, args.out, "gpt2", finish)

    smoke = args.smoke
    defaults = {"device": "cpu" if smoke else "cuda", "seqlens": "32,64" if smoke else "1024,4096",
                "runs": "fgen:nocompile,sdpa:nocompile,eager:nocompile" if smoke else
                "fgen,sdpa,flex_attention,eager,eager:nocompile",
                "curve": "fgen:0,sdpa:0,sdpa:1", "curve_steps": 3 if smoke else 300, "steps": 2 if smoke else 30,
                "warmup": 1 if smoke else 10, "batch_tokens": 128 if smoke else 16384}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.seqlens = [int(s) for s in args.seqlens.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"error: --seqlens: expected comma-separated integers, got {args.seqlens!r}") from None
    if not args.seqlens or min(args.seqlens) < 2:
        raise SystemExit(f"error: --seqlens: expected sequence lengths >= 2, got {args.seqlens}")
    if args.curve_seqlen is None:
        args.curve_seqlen = args.seqlens[0]
    if args.steps < 1 or args.warmup < 0 or args.curve_steps < 2:
        raise SystemExit("error: --steps must be >= 1, --warmup >= 0, --curve-steps >= 2")
    if not 0 <= args.profile_steps <= args.steps:
        raise SystemExit(f"error: --profile-steps: expected 0 to --steps ({args.steps}), got {args.profile_steps}")
    if smoke:
        args.layers, args.heads, args.width = 2, 4, 32
        args.tokenizer = "bytes" if args.tokenizer == "auto" else args.tokenizer
        args.no_compile = args.no_compile or not any(":" not in r for r in args.runs.split(","))
        if not args.no_compile and args.compile_backend == "inductor":
            args.compile_backend = "eager"  # --smoke: dynamo's tracing only (inductor's CPU build takes minutes)
    else:
        args.layers, args.heads, args.width = 12, 12, 768
    tag = args.tag or ("smoke" if smoke else "s" + "-".join(map(str, args.seqlens)))

    if args.threads is None and smoke:
        args.threads = 1
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads: expected >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    common.require_transformers()
    plt = common.require_matplotlib()
    device = common.check_device(args.device)
    runs = plan(args)
    budget = common.Budget(args.time_limit)
    common.register_backends()

    kind = pick_tokenizer(args.tokenizer)
    train_texts, val_texts, digest = corpus(limit=40 if smoke else None, val_every=10 if smoke else 100)
    if args.data_cache is None:
        args.data_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashgen-e2e"
    train_ids, val_ids, vocab, tok_s = tokenize(train_texts, val_texts, kind, args.vocab, args.data_cache, digest)
    data = {"train": train_ids.to(device).long(), "val": val_ids.to(device).long(), "vocab": vocab}
    need = max(args.seqlens) + 2
    if train_ids.numel() < need:
        raise SystemExit(f"error: --seqlens: the corpus has {train_ids.numel()} training tokens, fewer than {need}")

    report = {
        "what": "GPT-2 training from scratch through transformers (scripts/e2e_gpt2.py)",
        "smoke": smoke, "environment": common.environment(device),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"layers": args.layers, "heads": args.heads, "width": args.width,
                  "vocab": vocab, "embedding_rows": -(-vocab // 64) * 64},
        "corpus": {"source": str(sysconfig.get_paths()["stdlib"]), "files": len(train_texts) + len(val_texts),
                   "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(), "tokenizer": kind,
                   "vocab": vocab, "digest": digest, "tokenize_s": tok_s},
        "precision": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32",
        "runs": [],
    }
    path = args.out / f"gpt2-{tag}.json"
    if any(r["impl"] == "fgen" for r in runs):
        dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        report["fgen_build_s"] = common.build_fgen(device, dt, args.width // args.heads)
    failed = False
    spent: dict[int, float] = {}  # seconds per step, by sequence length, of the runs so far
    for r in runs:
        rec = {**r, "label": label(r)}
        estimate = spent.get(r["seqlen"], 0.0) * r["steps"]
        if not budget.fits(estimate):
            rec["status"] = f"skipped: about {estimate:.0f} s needed, {budget.left():.0f} s left of --time-limit"
        else:
            t0 = time.perf_counter()
            try:
                with common.FgenWarnings() as caught:
                    rec.update(train_run(args, r, data, device, budget))
                if caught.messages:
                    rec["warnings"] = caught.messages
                note = common.fgen_note(rec.get("fgen_calls", {}), rec.get("warnings"))
                if note:
                    rec["status"] += "; " + note
            except Exception as e:  # noqa: BLE001 (recorded; the other runs go on)
                if common.is_oom(e):
                    rec["status"] = "oom"
                else:
                    failed = True
                    rec["status"] = "error"
                    rec["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
            common.reset_memory(device)  # after the except clause: its traceback no longer holds the run
            common.dynamo_reset()
            spent[r["seqlen"]] = max(spent.get(r["seqlen"], 0.0), (time.perf_counter() - t0) / r["steps"])
        report["runs"].append(rec)
        report["elapsed_s"] = budget.elapsed()
        common.write_json(path, report)
        print(f"{rec['label']:>28} @ {r['seqlen']}: {rec['status']}"
              + (f", {rec['tokens_per_s']:,.0f} tokens/s" if rec.get("tokens_per_s") else ""), flush=True)

    finish(report, args.out, tag, plt)
    common.write_json(path, report)
    print(f"wrote {path}")
    return 1 if failed else 0


def loss_band(report: dict) -> dict | None:
    """How the flashgen loss curve sits against the band of the SDPA curves (issue 19's training
    check): None without one fgen curve and at least two sdpa curves of the same length. Per step
    the band is [min, max] of the SDPA losses; ``inside`` counts the steps where fgen's loss lies
    in it, ``excursion_max`` / ``excursion_median`` how far the others lie outside; ``same_seed``
    is |fgen - sdpa| of the SDPA run with fgen's seed (same initialisation and batches: the
    numerical difference alone), ``seed_spread`` the SDPA curves' max - min (what a change of
    seed does); ``last100`` the means over the last 100 steps."""
    curves = [r for r in report["runs"] if r.get("curve") and r.get("losses")]
    fgen = [r for r in curves if r["impl"] == "fgen"]
    sdpa = [r for r in curves if r["impl"] == "sdpa"]
    if len(fgen) != 1 or len(sdpa) < 2:
        return None
    f = fgen[0]["losses"]
    n = min(len(f), *(len(r["losses"]) for r in sdpa))
    lo = [min(r["losses"][i] for r in sdpa) for i in range(n)]
    hi = [max(r["losses"][i] for r in sdpa) for i in range(n)]
    out = [max(lo[i] - f[i], f[i] - hi[i]) for i in range(n) if not lo[i] <= f[i] <= hi[i]]
    twin = next((r for r in sdpa if r["seed"] == fgen[0]["seed"]), None)
    same = [abs(f[i] - twin["losses"][i]) for i in range(n)] if twin else []
    spread = [hi[i] - lo[i] for i in range(n)]
    tail = slice(max(0, n - 100), n)
    return {"steps": n, "sdpa_seeds": [r["seed"] for r in sdpa], "inside": n - len(out),
            "excursion_max": max(out, default=0.0), "excursion_median": sorted(out)[len(out) // 2] if out else 0.0,
            "same_seed_max": max(same, default=None), "same_seed_mean_last100": (sum(same[tail]) / len(same[tail]))
            if same else None, "seed_spread_max": max(spread), "seed_spread_mean_last100":
            sum(spread[tail]) / len(spread[tail]), "val_loss": {f"{r['impl']}:{r['seed']}": r.get("val_loss")
                                                               for r in fgen + sdpa}}


def finish(report: dict, out: Path, tag: str, plt) -> None:
    """The table (with ratios to sdpa and to uncompiled eager at each length), the loss band
    (``loss_band``, also into the report) and the plots."""
    report["loss_band"] = band = loss_band(report)
    if band:
        print(f"loss band over {band['steps']} steps: fgen inside the SDPA seeds' band at {band['inside']}; "
              f"outside by at most {band['excursion_max']:.4f} (median {band['excursion_median']:.4f}); "
              f"|fgen - sdpa, same seed| max {band['same_seed_max']:.4f}; SDPA seeds' spread max "
              f"{band['seed_spread_max']:.4f}, mean over the last 100 steps {band['seed_spread_mean_last100']:.4f}")
    runs = [r for r in report["runs"] if r["seed"] == 0]
    seqlens = sorted({r["seqlen"] for r in runs})
    for r in runs:  # ratios to sdpa compiled alike, and to uncompiled eager, at the same length
        same = {(x["impl"], x["compiled"]): x.get("tokens_per_s") for x in runs if x["seqlen"] == r["seqlen"]}
        tps = r.get("tokens_per_s")
        for ref, key in ((("sdpa", r["compiled"]), "vs_sdpa"), (("eager", False), "vs_eager_nocompile")):
            r[key] = tps / same[ref] if tps and same.get(ref) else None
    print(common.table(runs, [("label", "run"), ("seqlen", "seqlen"), ("batch", "batch"), ("status", "status"),
                              ("tokens_per_s", "tokens/s"), ("vs_sdpa", "× sdpa"),
                              ("vs_eager_nocompile", "× eager uncompiled"), ("peak_memory_gib", "peak GiB"),
                              ("graph_breaks", "graph breaks")]))
    if report["smoke"]:
        print("(--smoke: a tiny model on the CPU; these figures measure nothing)")
    labels = list(dict.fromkeys(r["label"] for r in runs))
    groups = [f"seqlen {s}" for s in seqlens]

    def series(key):
        return {lab: [next((r.get(key) for r in runs if r["label"] == lab and r["seqlen"] == s), None)
                      for s in seqlens] for lab in labels}
    title = (f"GPT-2 ({report['model']['layers']} layers, width {report['model']['width']}), "
             f"{report['environment'].get('gpu') or 'CPU'}, {report['precision']}")
    common.bar_plot(plt, out / f"gpt2-{tag}-tokens.png", groups, series("tokens_per_s"), "training tokens/s", title)
    if any(v is not None for vs in series("peak_memory_gib").values() for v in vs):
        common.bar_plot(plt, out / f"gpt2-{tag}-memory.png", groups, series("peak_memory_gib"),
                        "peak memory allocated (GiB)", title)
    curves = [r for r in report["runs"] if r.get("curve") and r.get("losses")]
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, r in enumerate(curves):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=0.8, color=f"C{i}",
                    label=f"{r['impl']} seed {r['seed']}"
                    + (f" (val {r['val_loss']:.3f})" if r.get("val_loss") is not None else ""))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("\n".join(textwrap.wrap(f"{title}, seqlen {curves[0]['seqlen']}", 90)), fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"gpt2-{tag}-loss.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
