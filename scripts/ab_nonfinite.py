"""A/B of DESIGN.md's non-finite rule in one process: the CUDA kernels as built (a NaN or +inf
score at a kept key gives a NaN row) against the same kernels built with FG_NONFINITE_LEGACY
(the old end-of-row test, which wrote such rows as empty ones: out 0, LSE −inf), alternating
rule, legacy, rule, legacy, ... (--rounds each, at least 5), median milliseconds per arm and
pass (CUDA events, flashgen.bench.time_fn; bf16, B·N = 16K, H·d = 2048).

    python3 scripts/ab_nonfinite.py --out ab_nonfinite.json [--rounds 5] [--n 4096] [--d 128]

Cases: dense and causal at head dim d and N keys, on the sm90 family (forward, and its own
backward where it serves the call, else sm80's) and on the sm80 family (both passes); the
forward (op(q, k, v)) and the backward alone (autograd.grad over a retained graph) timed
separately. The legacy arm is the same spec under another name (a separate cache entry) whose
translation units start with ``#define FG_NONFINITE_LEGACY 1`` (the script wraps the renderer;
the package has no switch for it). Every build lands in a fresh cache folder (--cache-dir to
reuse one), outside the timing. Before timing, each pair is checked: the two forwards agree bit
for bit on finite inputs (the backwards up to the order of their fp32 atomics: the largest
difference is reported), and on a q row holding NaN the rule's arm gives a NaN row where the legacy
arm gives 0 / −inf (so the A/B really compares the two builds).

JSON: one row per (family, spec, pass) with both medians, every round's times, and
ratio = rule / legacy (the rule's cost; the target is ≤ 1.01).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEGACY_SUFFIX = "_nonfinite_legacy"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--rounds", type=int, default=5, help="alternations per arm (at least 5)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per round")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--families", default="sm90,sm80")
    ap.add_argument("--cache-dir", help="the flashgen cache to build into (default: a fresh temporary folder)")
    a = ap.parse_args()
    if a.rounds < 5:
        ap.error("--rounds: at least 5 alternations")
    return a


def main() -> int:
    a = parse_args()
    os.environ["FLASHGEN_CACHE_DIR"] = a.cache_dir or tempfile.mkdtemp(prefix="fg-ab-nonfinite-")
    sys.path.insert(0, str(ROOT))
    import torch

    import flashgen
    from flashgen import bench, flops
    from flashgen.codegen import render

    original = render.render_instantiation

    def render_with_legacy(spec, *args, **kw):
        text = original(spec, *args, **kw)
        return "#define FG_NONFINITE_LEGACY 1\n" + text if spec.name.endswith(LEGACY_SUFFIX) else text

    render.render_instantiation = render_with_legacy

    dev = torch.device("cuda")
    n, d = a.n, a.d
    b, h = max(1, 16384 // n), max(1, 2048 // d)
    rows = []
    for family in a.families.split(","):
        for name in ("dense", "causal"):
            text = (ROOT / "specs" / f"{name}.attn").read_text()
            legacy_text = text.replace(f"attention {name} ", f"attention {name}{LEGACY_SUFFIX} ", 1)
            ops = {"rule": flashgen.compile(text), "legacy": flashgen.compile(legacy_text)}
            assert ops["legacy"].spec.name == name + LEGACY_SUFFIX, ops["legacy"].spec.name
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                             for _ in range(4))
            fl = flops.call_flops(ops["rule"].spec, n, n, d, batch=b, heads=h)
            with flashgen.use_family(family):
                bwd_family = ops["rule"].family_for(dev, torch.bfloat16, d, backward=True).family.name
                # the arms agree on finite inputs; they differ on a NaN row (out NaN vs 0)
                outs = {arm: op(q, k, v, return_lse=True) for arm, op in ops.items()}
                same = all(torch.equal(x, y) for x, y in zip(outs["rule"], outs["legacy"], strict=True))
                qn = q.clone()
                qn[0, 0, 5] = float("nan")
                o_rule, l_rule = ops["rule"](qn, k, v, return_lse=True)
                o_leg, l_leg = ops["legacy"](qn, k, v, return_lse=True)
                assert bool(o_rule[0, 0, 5].isnan().all() and l_rule[0, 0, 5].isnan()), "rule arm: NaN row not NaN"
                assert bool((o_leg[0, 0, 5] == 0).all() and l_leg[0, 0, 5].isneginf()), \
                    "legacy arm: FG_NONFINITE_LEGACY did not reach the build"
                # backward: one graph per arm, retained; the backward alone is timed
                graphs = {}
                for arm, op in ops.items():
                    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                    graphs[arm] = (op(*leaves), leaves)
                grads = {arm: torch.autograd.grad(o, lv, dout, retain_graph=True) for arm, (o, lv) in graphs.items()}
                # (the backwards' dQ sums in fp32 atomics: equal up to their order, not bit for bit)
                bwd_diff = max(float((x.float() - y.float()).abs().max())
                               for x, y in zip(grads["rule"], grads["legacy"], strict=True))
                times = {(arm, ps): [] for arm in ops for ps in ("fwd", "bwd")}
                for _ in range(a.rounds):
                    for arm, op in ops.items():
                        with torch.no_grad():
                            times[(arm, "fwd")].append(
                                bench.time_fn(lambda op=op: op(q, k, v), dev, warmup=3, reps=a.reps))
                        o, lv = graphs[arm]
                        times[(arm, "bwd")].append(bench.time_fn(
                            lambda o=o, lv=lv: torch.autograd.grad(o, lv, dout, retain_graph=True), dev,
                            warmup=3, reps=a.reps))
            for ps in ("fwd", "bwd"):
                rule, legacy = (statistics.median(times[(arm, ps)]) for arm in ("rule", "legacy"))
                row = {"family": family if ps == "fwd" else bwd_family, "spec": name, "pass": ps, "d": d, "n": n,
                       "batch": b, "heads": h, "rule_ms": rule, "legacy_ms": legacy, "ratio": rule / legacy,
                       "rule_rounds_ms": times[("rule", ps)], "legacy_rounds_ms": times[("legacy", ps)],
                       "tflops_rule": fl * (2.5 if ps == "bwd" else 1.0) / rule / 1e9,
                       "device": torch.cuda.get_device_name()}
                if ps == "fwd":
                    row["bit_equal_on_finite_inputs"] = same
                else:
                    row["max_abs_diff_on_finite_inputs"] = bwd_diff
                rows.append(row)
                agree = f"bit-equal {same}" if ps == "fwd" else f"max |diff| {bwd_diff:.2e}"
                print(f"{row['family']:5s} {name:7s} {ps} d{d} N{n}: rule {rule:.3f} ms, legacy {legacy:.3f} ms, "
                      f"ratio {row['ratio']:.4f}, {agree}", flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.4f} (target <= 1.01)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
