"""Check `flashgen explain`'s predicted forward bytes against Nsight Compute's counters on one GPU.

    python3 scripts/measure_bytes.py [--out bytes.json] [--quick] [--ncu PATH]

For causal and dense bf16 forwards at d = 64 and 128, N = 4096 and 16384 (B · N = 16K tokens,
H · d = 2048, the benchmark grid; --quick: N = 4096 only) this computes explain's prediction
(flashgen.explain: hbm_bytes with the kernel's real tiles, compulsory_bytes), then runs each
forward once in a child process under

    ncu --clock-control none --cache-control all --target-processes all --kernel-name regex:fwd_kernel
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,
                  lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,
                  smsp__inst_executed_op_ldgsts.sum
        --csv --print-units base  python3 scripts/measure_bytes.py --child CASES

and reads, per forward kernel: the bytes its loads request (executed cp.async warp instructions ×
512 B: the kernel reads global memory with nothing else), compared with the predicted reads (Q
once, K and V once per query tile over the visited key tiles); the bytes stored, as L2 write
sectors × 32 B, against the predicted O and LSE writes; the L2 read sectors from the SMs (shown,
not the check: on the H200 they count about 1.5 sectors per requested 32 bytes of this cp.async
traffic, a counter behaviour we have not explained); and DRAM bytes read, which with the caches
flushed before the kernel (--cache-control all) should lie between the compulsory reads (Q, K, V
once) and the predicted reads: K/V re-reads mostly hit L2. DRAM writes can fall below the O
bytes (the L2 is write-back: part of O is still in it when the kernel ends).

If ncu is missing or cannot read the counters (some virtualised machines), no substitute is
measured (a timing-based bandwidth figure says nothing about bytes): the output says "ncu
unavailable" with the error text, next to the predictions. The kernels are built before
profiling (the first run on a machine includes those compiles); the profiled part takes well
under two minutes on an H200.

Output: a table on stdout and, with --out, JSON {"method", "gpu", "cases": [{spec, batch, heads,
seqlen, head_dim, predicted: {hbm_bytes, compulsory_bytes, terms, tiles}, measured: {...} | null,
ratios}], "error"}.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
           "lts__t_sectors_srcunit_tex_op_write.sum", "smsp__inst_executed_op_ldgsts.sum")
# The forward reads global memory only with cp.async (LDGSTS) of 16 bytes per lane, whole warps:
# 512 bytes requested per executed warp instruction (predicated-off lanes of tail tiles included;
# the benchmark grid has none).
LDGSTS_BYTES = 32 * 16
SECTOR = 32  # bytes per L2 sector
UNITS = {"byte": 1, "sector": 1, "": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
         "kibyte": 1 << 10, "mibyte": 1 << 20, "gibyte": 1 << 30, "ksector": 1e3, "msector": 1e6, "gsector": 1e9}


def cases(quick: bool) -> list[dict]:
    out = []
    for spec in ("causal", "dense"):
        for d in (64, 128):
            for n in ((4096,) if quick else (4096, 16384)):
                out.append({"spec": spec, "batch": max(1, 16384 // n), "heads": 2048 // d, "seqlen": n, "head_dim": d})
    return out


def find_ncu(given: str | None) -> str | None:
    if given:
        return given if Path(given).is_file() else shutil.which(given)
    exe = shutil.which("ncu")
    if exe:
        return exe
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    for home in homes:
        if home and (Path(home) / "bin" / "ncu").is_file():
            return str(Path(home) / "bin" / "ncu")
    found = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/nsight-compute*/ncu"))
    return found[-1] if found else None


# ---------------------------------------------------------------- child: run each forward once


def child(spec_json: str) -> int:
    import torch

    import flashgen

    todo = json.loads(spec_json)
    for c in todo:
        op = flashgen.compile(ROOT / "specs" / f"{c['spec']}.attn")
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (c["batch"], c["heads"], c["seqlen"], c["head_dim"])
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        torch.cuda.synchronize()
        with torch.no_grad():
            op(q, k, v)  # the one profiled fwd_kernel launch of this case
        torch.cuda.synchronize()
        del q, k, v
        print(f"child: ran {c['spec']} {shape}", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------- parent


def parse_ncu_csv(text: str) -> list[dict[str, float]]:
    """Per profiled kernel launch (in order): {metric: value in bytes or sectors}. Accepts the
    'details' page (a row per metric) and the 'raw' page (a row per launch, then units)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in lines[start:] if ln.startswith('"')))))
    header, body = rows[0], rows[1:]

    def num(s: str) -> float:
        return float(s.replace(",", "")) if s.strip() not in ("", "n/a") else float("nan")

    launches: dict[str, dict[str, float]] = {}
    if "Metric Name" in header:
        col = {name: header.index(name) for name in ("ID", "Metric Name", "Metric Unit", "Metric Value")}
        for r in body:
            if len(r) < len(header):
                continue
            metric = r[col["Metric Name"]]
            if metric in METRICS:
                unit = r[col["Metric Unit"]].strip().lower()
                launches.setdefault(r[col["ID"]], {})[metric] = num(r[col["Metric Value"]]) * UNITS.get(unit, 1)
    else:
        idx = {m: header.index(m) for m in METRICS if m in header}
        units = {}
        for r in body:
            if r and r[0] == "":  # the units row
                units = {m: r[i].strip().lower() for m, i in idx.items()}
                continue
            launches[r[0]] = {m: num(r[i]) * UNITS.get(units.get(m, ""), 1) for m, i in idx.items()}
    return [launches[k] for k in sorted(launches, key=lambda x: int(x) if x.isdigit() else 0)]


def predict(c: dict) -> dict:
    from flashgen import explain

    rep = explain.explain(ROOT / "specs" / f"{c['spec']}.attn", c["seqlen"], head_dim=c["head_dim"], batch=c["batch"],
                          heads=c["heads"], dtype="bf16", device="cuda")
    return {"hbm_bytes": rep.hbm_bytes, "compulsory_bytes": rep.compulsory_bytes, "terms": rep.fwd.terms,
            "tile": rep.tiles["fwd"].shape, "tile_origin": rep.tiles["fwd"].origin, "flops": rep.flops,
            "gpu": rep.gpu}


def run_ncu(ncu: str, todo: list[dict]) -> tuple[list[dict] | None, str]:
    """Profile the child; (per-launch metrics, '') or (None, the error text)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ncu.log"
        cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--target-processes", "all",
               "--kernel-name", "regex:fwd_kernel", "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
               "--log-file", str(log), sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(todo)]
        try:
            res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{type(e).__name__}: {e}"
        text = (log.read_text() if log.exists() else "") + "\n" + res.stdout
    launches = parse_ncu_csv(text)
    if res.returncode != 0 or len(launches) != len(todo) or any(len(x) != len(METRICS) for x in launches):
        err = [ln for ln in (text + "\n" + res.stderr).splitlines() if "ERR" in ln or "error" in ln.lower()]
        detail = "\n".join(err[-8:]) or (text + res.stderr).strip()[-1500:]
        return None, (f"ncu exit {res.returncode}, {len(launches)} profiled launches for {len(todo)} cases:\n{detail}")
    return launches, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="N = 4096 only")
    ap.add_argument("--ncu", help="path of ncu (default: PATH, CUDA_HOME/bin, /opt/nvidia/nsight-compute)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child)

    import torch

    import flashgen

    if not torch.cuda.is_available():
        print("measure_bytes: needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("FLASHGEN_QUIET", "1")
    todo = cases(args.quick)
    t0 = time.perf_counter()
    for spec in sorted({c["spec"] for c in todo}):  # compile outside the profiled process
        flashgen.compile(ROOT / "specs" / f"{spec}.attn").build("cuda", ["bf16"], sorted({c["head_dim"] for c in todo}),
                                                                decode=False)
    build_s = time.perf_counter() - t0
    preds = [predict(c) for c in todo]
    ncu = find_ncu(args.ncu)
    t1 = time.perf_counter()
    if ncu is None:
        launches, error = None, "ncu not found (PATH, CUDA_HOME/bin, /opt/nvidia/nsight-compute)"
    else:
        launches, error = run_ncu(ncu, todo)
    profile_s = time.perf_counter() - t1
    method = (f"Nsight Compute ({ncu}): smsp__inst_executed_op_ldgsts.sum × 512 B, "
              "lts__t_sectors_srcunit_tex_op_read/write.sum × 32 B, dram__bytes_read/write.sum, caches flushed "
              "before each kernel" if launches else f"ncu unavailable: {error}")
    results = []
    for i, (c, p) in enumerate(zip(todo, preds, strict=True)):
        row = {**c, "predicted": p, "measured": None, "ratios": None}
        t = p["terms"]
        p["reads"] = sum(v for k, v in t.items() if "read" in k)
        p["writes"] = sum(v for k, v in t.items() if "write" in k)
        p["compulsory_reads"] = p["compulsory_bytes"] - p["writes"]
        if launches:
            m = launches[i]
            issued = m["smsp__inst_executed_op_ldgsts.sum"] * LDGSTS_BYTES
            stored = m["lts__t_sectors_srcunit_tex_op_write.sum"] * SECTOR
            l2_read = m["lts__t_sectors_srcunit_tex_op_read.sum"] * SECTOR
            row["measured"] = {"requested_read_bytes": issued, "stored_bytes": stored, "l2_read_sector_bytes": l2_read,
                               "dram_read_bytes": m["dram__bytes_read.sum"],
                               "dram_write_bytes": m["dram__bytes_write.sum"], "raw": m}
            row["ratios"] = {"requested_reads / predicted_reads": issued / p["reads"],
                             "stored / predicted_writes": stored / p["writes"],
                             "l2_read_sectors / predicted_reads": l2_read / p["reads"],
                             "dram_reads / predicted_reads": m["dram__bytes_read.sum"] / p["reads"],
                             "dram_reads / compulsory_reads": m["dram__bytes_read.sum"] / p["compulsory_reads"]}
        results.append(row)
    gpu = torch.cuda.get_device_name()
    print(f"# forward bytes on {gpu}: {method}")
    print(f"# build {build_s:.1f} s, profiling {profile_s:.1f} s")
    hdr = (f"{'spec':8s} {'B':>3s} {'H':>3s} {'N':>6s} {'d':>4s} {'tile':>9s} {'pred reads':>11s} {'requested':>11s} "
           f"{'ratio':>6s} {'pred writes':>11s} {'stored':>11s} {'ratio':>6s} {'L2 rd sect':>11s} {'DRAM rd':>11s} "
           f"{'in range':>8s}")
    print(hdr)
    gb = lambda x: f"{x / 1e9:9.3f}GB"
    for r in results:
        p, m = r["predicted"], r["measured"]
        line = (f"{r['spec']:8s} {r['batch']:3d} {r['heads']:3d} {r['seqlen']:6d} {r['head_dim']:4d} {p['tile']:>9s} "
                f"{gb(p['reads']):>11s}")
        if m:
            q = r["ratios"]
            inside = p["compulsory_reads"] * 0.98 <= m["dram_read_bytes"] <= p["reads"] * 1.02
            r["dram_in_range"] = inside
            line += (f" {gb(m['requested_read_bytes']):>11s} {q['requested_reads / predicted_reads']:6.3f}"
                     f" {gb(p['writes']):>11s} {gb(m['stored_bytes']):>11s} {q['stored / predicted_writes']:6.3f}"
                     f" {gb(m['l2_read_sector_bytes']):>11s} {gb(m['dram_read_bytes']):>11s} {'yes' if inside else 'NO':>8s}")
        else:
            line += "   (not measured)"
        print(line)
    if error:
        print(f"# {error}")
    if args.out:
        args.out.write_text(json.dumps({"method": method, "gpu": gpu, "error": error or None, "build_s": build_s,
                                        "profile_s": profile_s, "cases": results}, indent=1))
    return 0 if launches else 1


if __name__ == "__main__":
    sys.exit(main())
