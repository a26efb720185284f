"""``flashgen explain``: what a call of a spec costs, and where that comes from.

For one shape (batch B, query heads Hq, kv heads Hkv, Nq queries, Nk keys, head dim d, element
size e bytes) this reports the tiles a call uses and where they came from (environment, tuned,
table, derived), their shared memory and registers per block, the FLOPs, the HBM bytes our
kernel moves with its real tiles next to standard attention's, and the roofline floor on a GPU
(the live one, or an architecture's datasheet figures from flashgen.tiles.ARCHS) or, on a
machine without one, on this CPU (peaks measured here). ``measure=True`` times the call and
reports the achieved fraction of that floor.

Counting rules (all totals are over the whole call, every batch element and head):

FLOPs (FlashAttention-2 convention, Dao 2023, §4): forward 4 · B · Hq · d · P, where P is the
number of visible (query, key) pairs per (batch, query head) — Nq · Nk dense, the kept entries
for a masked spec (as flashgen.reference.visible_pairs counts them, from the mask geometry below;
tensor parameters only the score reads do not change it); backward 2.5× the forward (5 matmuls
instead of 2). Masked entries a tile computes anyway are not counted.

Forward HBM bytes, our kernel (FlashAttention, Dao et al. 2022, Theorem 2: Θ(N² d² / M) — here
with the kernel's actual tiles instead of the asymptotic M): per (batch, query head), Q is read
once (Nq · d · e; query tiles that see no key skip it), O written once (Nq · d · e), the LSE
written once (4 · Nq); K and V are read once per query tile for the keys that tile loads:
Σ_i (keys loaded by query tile i) · d · e · 2. For a mask with a closed-form key range per row
(no mask, causal, windows, prefix-LM, key padding: ``kRowExact``) query tile i loads exactly the
keys of its range [kv_lo, kv_hi), the hull of the keys its rows keep (rows outside the range are
zero-filled, never read). For a mask without one (document ids) the CUDA kernel visits the key
tiles that keep at least one (query, key) pair of the tile (its block lists, built per call) and
loads each whole, clipped to [0, Nk) — an upper bound by at most one tile per query tile where
the spec's closed-form bound cuts a listed tile. K/V are counted per *query* head: each query
head's CTAs load their kv head's K/V (GQA saves capacity, not these loads).

Backward HBM bytes (the non-deterministic CUDA path, FlashAttention-2 Alg. 2):
  preprocess: read O and dO (2 · Nq · d · e), write D (4 · Nq), zero the fp32 dQ accumulator
    (4 · Nq · d);
  main kernel, per (key tile, kv head, split): read K and V once for the rows of the tile inside
    the union of its visiting query tiles' key ranges, write dK and dV (2 · Nk · d · e per kv
    head), or with the GQA split add them into fp32 workspaces with atomics (2 · 2 · 4 · d per
    key row per split; zeroed by the preprocess and converted after: read 2 · 4 · d, write
    2 · d · e per key row); for each query tile it visits, per query head of its share: read Q and
    dO (2 · d · e per row), LSE and D (2 · 4 per row), and add the dQ partial into the fp32
    accumulator with atomics (read + write, 2 · 4 · d per row);
  convert: read the accumulator (4 · Nq · d), write dq (Nq · d · e);
  workspaces: ops._backward allocates the dQ accumulator (and, for GQA, the dK/dV workspaces)
    with torch.zeros (4 · d per row written).
The deterministic path (a dQ kernel instead of atomics) is not modelled.

Tensor parameters (the spec's ``param NAME: T[...]``; each at its actual shape, ``batch|1`` /
``heads|1`` dims at the full size the explain call builds them, element size 4 for f32 / i32, 8
for i64, 1 for bool). A tensor indexed by both the query and the key position (an index using q
but not kv and another using kv but not q, like bias[b, h, q, kv]) is read per visited element:
its element size times the elements of the visited tiles (forward: Σ_i rows of query tile i ·
keys it loads; backward: the same with the backward's query tiles), per (batch, query head) work
item — dims broadcast over batch or heads are re-read by every work item. Other tensors (per
batch or head vectors, small tables, document ids) are read once per kernel. With ``backward``,
each f32 tensor that gets a gradient (flashgen.lang.expr.grad_params: it enters the score) costs a
torch.zeros fill of its fp32 gradient (4 bytes per element) and fp32 atomics (read + write, 2 · 4
bytes) per visited element and read of it in the score. Terms: "tensor param NAME: ...". Only the
parameters the mask reads are evaluated (mask geometry, visible pairs); the others need only their
shape (explain never materialises them, unless ``measure``).

Standard attention (FlashAttention, Alg. 0 and Alg. 3, its standard backward; GQA: K/V
expanded per query head, as standard implementations do), per (batch, query head):
  forward  e · (2 · Nq · d + 2 · Nk · d + 4 · Nq · Nk): read Q, K; write S; read S, write P;
           read P, V; write O;
  backward e · (4 · Nq · d + 4 · Nk · d + 7 · Nq · Nk): read P, dO, write dV; read dO, V, write
           dP; read P, dP, write dS; read dS, K, write dQ; read dS, Q, write dK.
  plus each tensor parameter read once in the forward (S = Q Kᵀ + bias) and, with ``backward``,
  each parameter gradient written once.

Compulsory bytes (``compulsory_terms``): what the kernel reads at all, each byte once, and its
outputs written once. Forward: the Q rows of query tiles that see a key, K and V for the keys
the kernel reads at all — the union over query tiles of their visited key ranges (block lists:
occupied key tiles), per (batch, kv head) (a window or padding mask skips the rest) —, O and the
LSE; each tensor parameter's bytes once (a (q, kv)-indexed one scaled by the fraction of its
(q, kv) elements the kernel visits, all of it when no key is skipped). Backward: O, dO, dQ, dK,
dV once; Q and the LSE for the rows of query tiles that visit a key tile; K and V over the union
of the backward's key ranges; the parameters as in the forward, plus each gradient written once.
K/V are capped at the kernel's own K/V reads (the GQA backward's per-group average can fall
below a per-head mask's union), so compulsory_bytes ≤ hbm_bytes, term by term.

Roofline: floor_ms = max(FLOPs / peak, hbm_bytes / bandwidth); ``bound`` names the larger
term. GPU peaks are vendor datasheet figures (dense bf16/fp16 tensor cores, HBM bandwidth);
the CPU family's are measured once per process (an fp32 matmul, a large copy). The predicted
bytes count every global load the kernel issues: they are what reaches L2; K/V re-reads mostly
hit L2, so DRAM bytes lie between ``compulsory_bytes`` and ``hbm_bytes`` and the floor is an
upper estimate of the memory term (``compulsory_floor_ms`` uses the compulsory bytes: a lower
estimate, ≤ ``floor_ms``).

How the mask is counted: no mask and the causal masks in closed form; a mask with a closed-form
key range per row (``kRowExact``: windows, chunks, prefix-LM, key padding, ...) from its per-row
bounds — the symbolic range flashgen.lang.keyrange.key_range derives, which the kernels print as C++,
evaluated over every query row with flashgen.reference.evaluate: O(Nq) time and memory; any
other mask evaluated element by element in chunks of query rows (O(Nq · Nk) time, bounded
memory).

The kernel family that serves the call (flashgen.families.choose: the registry's order, or a
forced family) picks the model of tiles and peaks: explain/sm80_model.py (flashgen.tiles'
tiles, registers from the compiled library, the GQA split of flashgen.families.sm80) or
explain/cpu_model.py (the CPU family's tile choice, flashgen/families/cpu_tiles.py — the
function its launches call: sized from the L2 cache, query tile by a load-balance cost model
over torch.get_num_threads() threads; its bytes use the same model). The report names the family,
the device type and why that family serves the call.

Modules, one stage each: ``inputs`` (arguments and parameter values), ``target`` (device,
architecture and the family model's interface), ``geometry`` (mask geometry, tile visits),
``traffic`` (the byte model), ``cpu_model`` / ``sm80_model`` (per kernel family), ``report``
(dataclasses, JSON, rendering) and ``entry`` (``explain`` itself).
"""

from __future__ import annotations

from .cpu_model import cpu_l2_bytes, cpu_peaks, cpu_tiles
from .entry import MODELS, explain
from .geometry import Geometry, compute_geometry, row_bounds
from .inputs import as_dtype, materialize, spec_params
from .report import Report, TileReport, Traffic, fmt_bytes, render, to_json
from .sm80_model import resource_usage
from .traffic import ACC_BYTES, ELEMENT_BYTES, LSE_BYTES, PARAM_BYTES

__all__ = ["ACC_BYTES", "ELEMENT_BYTES", "LSE_BYTES", "MODELS", "PARAM_BYTES", "Geometry", "Report", "TileReport",
           "Traffic", "as_dtype", "compute_geometry", "cpu_l2_bytes", "cpu_peaks",
           "cpu_tiles", "explain", "fmt_bytes", "materialize", "render", "resource_usage", "row_bounds",
           "spec_params", "to_json"]
