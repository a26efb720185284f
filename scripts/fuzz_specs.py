"""The spec fuzzer's long run: random well-typed specs (flashgen/tools/fuzz_gen.py), each checked
(flashgen/tools/fuzz_check.py) for parsing, its hooks' soundness against the reference, and — for
the first --kernels of them — the CPU kernels' forward and backward against the float64 reference.

    python scripts/fuzz_specs.py --count 2000 --seed 0 --kernels 200

Seeds are --seed, --seed + 1, ...; a failure prints its seed, and
`python scripts/fuzz_specs.py --count 1 --seed SEED --kernels 1 --show` replays it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from flashgen.tools import fuzz_check, fuzz_gen


def _report(failures: dict, seed: int, problems: list[str]) -> None:
    """Record and print a seed's problems as they are found (a long run may be cut short)."""
    if problems:
        failures.setdefault(seed, []).extend(problems)
        for p in problems[:3]:
            print(f"FAIL seed {seed}: {p}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100, help="specs to draw (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--kernels", type=int, default=0, help="of those, how many also run the CPU kernels (default 0)")
    ap.add_argument("--batch", type=int, default=8, help="specs per kernel build (default 8)")
    ap.add_argument("--hooks-batch", type=int, default=100, help="specs per hook binary (default 100)")
    ap.add_argument("--show", action="store_true", help="print each spec's text")
    args = ap.parse_args(argv)
    os.environ["FLASHGEN_CPU_TILES"], os.environ["FLASHGEN_CPU_BWD_TILES"] = fuzz_check.small_tiles()
    fuzz_check.clear_tile_overrides()
    start = time.perf_counter()
    seeds = list(range(args.seed, args.seed + args.count))
    failures: dict[int, list[str]] = {}
    counts = {"parsed": 0, "hooks": 0, "kernels": 0}
    seen: collections.Counter = collections.Counter()
    for c in range(0, len(seeds), args.hooks_batch):
        chunk = seeds[c:c + args.hooks_batch]
        fzs = {s: fuzz_gen.generate(s) for s in chunk}
        specs = {}
        for s, fz in fzs.items():
            if args.show:
                print(fz.text)
            seen.update(fuzz_check.features(fz))
            spec, probs = fuzz_check.check_parse(fz)
            if probs:
                failures[s] = probs
            if spec is not None:
                specs[s] = spec
                counts["parsed"] += not probs
        try:
            hooks = fuzz_check.HookBinary(specs)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            failures.setdefault(chunk[0], []).append(str(e))
            continue
        for s, spec in specs.items():
            probs = fuzz_check.check_hooks(fzs[s], spec, hooks) + fuzz_check.check_far(fzs[s], spec, hooks)
            _report(failures, s, probs)
            counts["hooks"] += 1
        kern = [s for s in specs if s - args.seed < args.kernels]
        for b in range(0, len(kern), args.batch):
            part = {s: specs[s] for s in kern[b:b + args.batch]}
            try:
                ops = fuzz_check.build_kernels(part)
            except Exception as e:  # noqa: BLE001 - a finding
                failures.setdefault(kern[b], []).append(f"seeds {list(part)}: kernels do not build: {e}"[:3000])
                continue
            for s, spec in part.items():
                probs = fuzz_check.check_kernels(fzs[s], spec, ops[s])
                _report(failures, s, probs)
                counts["kernels"] += 1
            print(f"... {counts['kernels']} kernel specs, {time.perf_counter() - start:.0f} s", flush=True)
        print(f"... {c + len(chunk)} specs drawn, {time.perf_counter() - start:.0f} s", flush=True)
    failures = {s: p for s, p in failures.items() if p}
    print("failing seeds:", sorted(failures) or "none")
    print("coverage (specs using each):", ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
    print(f"seeds {args.seed}..{args.seed + args.count - 1}: {counts['parsed']} parsed, {counts['hooks']} hook "
          f"checks, {counts['kernels']} kernel checks, {len(failures)} failing, "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
