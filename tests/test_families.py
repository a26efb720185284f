"""Kernel families behind one registry: the order they are tried in, what each serves, why a
call runs where it runs, and forcing one (FLASHGEN_FAMILY, use_family, op.build(family=),
--family) without ever falling back."""

import itertools

import pytest
import torch
from conftest import SPECS

import flashgen
from flashgen import cli, families, ops
from flashgen.build import artifact
from flashgen.families import sm90 as sm90_family
from flashgen.lang import ir


@pytest.fixture(scope="module")
def causal():
    return flashgen.compile(SPECS / "causal.attn")


def test_registry_order_and_features():
    assert list(families.FAMILIES) == ["sm90", "sm80", "cpu"]
    sm90, sm80, cpu = families.get("sm90"), families.get("sm80"), families.get("cpu")
    assert (sm90.device, sm80.device, cpu.device) == ("cuda", "cuda", "cpu")
    assert ir.DType.FP32 in cpu.dtypes and ir.DType.FP32 not in sm80.dtypes
    assert ops.DROPOUT_BACKENDS == ("sm90", "sm80", "cpu")
    assert ops.VARLEN_BACKENDS == ("sm90", "sm80", "cpu")
    with pytest.raises(ValueError, match="family: unknown kernel family 'sm70' .*sm90, sm80, cpu"):
        families.get("sm70")
    # A device type names its complete family (the one that serves every call there).
    assert families.of("cuda") is sm80 and families.of("cpu") is cpu and families.of(sm80) is sm80
    assert not families.complete(sm90) and families.complete(sm80) and families.complete(cpu)


def test_sm90_declares_what_it_serves(causal):
    """sm90 serves the forward (dropout, block lists, packed batches) at head dims up to 256 on
    sm_90a; the backward only where test_sm90_backward_serves_and_declines says, and otherwise
    goes to sm80, the choice naming what sm90 lacks."""
    sm90 = families.get("sm90")
    assert sm90.head_dims == tuple(range(8, 257, 8))
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, 128)
    assert families.choose(causal.spec, call).family is sm90
    for d, feats in ((64, {"dropout"}), (128, {"sparse"}), (256, {"sparse", "dropout"}), (200, {"varlen"}), (128, {"varlen", "sparse"})):
        assert families.choose(causal.spec, families.Call("cuda", "sm_90a", ir.DType.FP16, d,
                                                          frozenset(feats))).family is sm90
    for d, feats, lacks in ((256, ("backward",), "backward kernels at head_dim 256"),
                            (96, ("sparse", "backward"), "backward kernels at head_dim 96")):
        choice = families.choose(causal.spec, families.Call("cuda", "sm_90a", ir.DType.BF16, d, frozenset(feats)))
        assert choice.family.name == "sm80" and choice.tried[0][0] == "sm90" and lacks in choice.tried[0][1]
    choice = families.choose(causal.spec, families.Call("cuda", "sm_80", ir.DType.BF16, 128))
    assert choice.family.name == "sm80" and "needs compute capability 9.0" in choice.why()
    assert families.for_arch("cuda", "sm_90a").name == "sm80"
    assert [f.name for f in families.for_arch_all("cuda", "sm_90a")] == ["sm90", "sm80"]
    assert [f.name for f in families.for_arch_all("cuda", "sm_86")] == ["sm80"]
    with flashgen.use_family("sm90"):
        assert [f.name for f in families.for_arch_all("cuda", "sm_90a")] == ["sm90"]


BWD = frozenset({"backward"})


EVERY_SPEC = sorted(p.stem for p in SPECS.glob("*.attn"))


@pytest.mark.parametrize("name", EVERY_SPEC)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [ir.DType.FP16, ir.DType.BF16])
def test_sm90_backward_serves_every_spec(name, d, dtype):
    """The sm90 backward serves every spec (masks, score expressions, parameters, dropout) at head
    dims 64 and 128, fp16/bf16, in the padded and packed layouts, GQA or not, deterministic or
    not (deterministic ones too: the automatic choice takes sm90 for them, except for masks
    without a closed-form key range, which it defers to sm80's block-list deterministic pass). Its
    instantiations (padded and packed) carry the backward unit."""
    op = flashgen.compile(SPECS / f"{name}.attn")
    spec = op.spec
    feats = BWD | ({"dropout"} if spec.dropout else set())
    for gqa, packed, det in itertools.product((False, True), repeat=3):
        call = families.Call("cuda", "sm_90a", dtype, d, frozenset(feats | ({"varlen"} if packed else set())), gqa, det)
        assert families.choose(spec, call, "sm90").family.name == "sm90"
        choice = families.choose(spec, call)
        if det and op.auto_sparse:
            assert choice.family.name == "sm80", choice.why()
            assert choice.tried[0][0] == "sm90" and "defers deterministic" in choice.tried[0][1], choice.why()
        else:
            assert choice.family.name == "sm90" and not choice.tried, choice.why()
    for packed, sparse in itertools.product((False, True), repeat=2):
        inst = families.get("sm90").instantiation(spec, "sm_90a", dtype, d, packed=packed, sparse=sparse)
        cfg = dict(inst.config)
        assert inst.kinds == ("fwd", "bwd") and "fwd_only" not in cfg
        # 128 query rows per step at d 64 for specs without a score expression, dropout or
        # parameter gradients (sm90.bwd_block_m), else 64
        plain = spec.score is None and not spec.dropout and not op.grad_params
        assert (cfg["bwd90_block_m"], cfg["bwd90_stages"]) == (128 if d == 64 and plain else 64, 2), (name, d)
        text = inst.sources()[inst.source_name("bwd")]
        assert '#include "flashgen/sm90/bwd.cuh"' in text
        flag = lambda x: "true" if x else "false"  # noqa: E731
        assert f"FgBwdTile, {flag(packed)}, {flag(sparse)}>(*args)" in text
        # the backward's q lists are at its own tiles: 128 keys x its query rows
        assert families.get("sm90").block_tiles(lambda: cfg, (128, 128))[2:4] == (128, cfg["bwd90_block_m"])


@pytest.mark.parametrize(("spec", "d", "feats", "kw", "lacks"), [
    ("causal", 256, (), {}, "head_dim 256"),
    ("causal", 96, (), {}, "head_dim 96"),
    ("causal", 128, ("sparse",), {"deterministic": True}, "block lists"),
    ("alibi", 64, ("sparse",), {"gqa": True, "deterministic": True}, "block lists"),
    ("dropout", 256, ("dropout",), {}, "head_dim 256"),
    ("sliding_window", 128, ("sparse", "varlen"), {"deterministic": True}, "block lists"),
])
def test_sm90_backward_declines_the_rest(spec, d, feats, kw, lacks):
    """Every other backward call runs on sm80, and the choice names the feature sm90 lacks; a
    forced sm90 raises naming it."""
    sp = flashgen.compile(SPECS / f"{spec}.attn").spec
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, d, BWD | frozenset(feats), **kw)
    choice = families.choose(sp, call)
    assert choice.family.name == "sm80" and choice.tried[0][0] == "sm90", choice.why()
    assert lacks in choice.tried[0][1], choice.tried
    with flashgen.use_family("sm90"), pytest.raises(NotImplementedError, match="family sm90"):
        families.choose(sp, call)
    # The forward of the same call stays on sm90; instantiations other than the served backward's
    # stay forward-only.
    fwd = families.Call("cuda", "sm_90a", ir.DType.BF16, d, frozenset(feats))
    assert families.choose(sp, fwd).family.name == "sm90"
    if not kw:
        inst = families.get("sm90").instantiation(sp, "sm_90a", ir.DType.BF16, d, packed="varlen" in feats,
                                                  sparse="sparse" in feats)
        assert inst.kinds == ("fwd",)


def test_sm90_backward_choice_through_the_op(causal):
    """op.choose_family passes a backward's GQA and deterministic flags into its Call."""
    dev = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(artifact, "cuda_arch_of", lambda index: "sm_90a")
        pick = lambda **kw: causal.choose_family(dev, ir.DType.BF16, 128, False, False, False, backward=True,  # noqa: E731
                                                 **kw).family.name
        assert pick() == "sm90" and pick(gqa=True) == "sm90"
        # deterministic reaches the Call: sm90 serves it, without block lists
        assert pick(deterministic=True) == "sm90" and pick(gqa=True, deterministic=True) == "sm90"
        assert pick(deterministic=True, family="sm80") == "sm80"
        assert causal.choose_family(dev, ir.DType.BF16, 128, False, True, False, backward=True,
                                    deterministic=True).family.name == "sm80"  # block lists
        # the forward ignores both
        assert causal.choose_family(dev, ir.DType.BF16, 128, False, False, False, gqa=True,
                                    deterministic=True).family.name == "sm90"


def test_sm90_tiles_are_its_own(causal):
    sm90 = families.get("sm90")
    # another family's tile keys are dropped; its own are checked
    cfg = dict(sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 128, tiles={"fwd_block_m": 64, "fwd_block_n": 64}))
    assert cfg == {"fwd_block_n": 64, "fwd_stages": 2, "fwd_overlap": 1, "fwd_pingpong": 0, "fwd_persistent": 4096,
                   "bwd90_block_m": 64, "bwd90_stages": 2}  # (the causal backward at d 128 is sm90's too)
    masked = [dict(sm90.config(causal.spec, "sm_90a", ir.DType.BF16, d)) for d in (64, 128, 256)]
    assert [(c["fwd_overlap"], c["fwd_persistent"]) for c in masked] == [(0, 4096), (1, 4096), (0, 4096)]
    dense = flashgen.compile(SPECS / "dense.attn").spec
    cfgs = [dict(sm90.config(dense, "sm_90a", ir.DType.BF16, d)) for d in (64, 128, 192, 256)]
    assert [(c["fwd_block_n"], c["fwd_overlap"], c["fwd_persistent"]) for c in cfgs] == \
        [(128, 0, 1 << 30), (128, 1, 1 << 30), (80, 1, 2048), (80, 1, 2048)]
    # d <= 64 without score expressions or tensor reads: three consumer warpgroups (not sparse)
    assert [c.get("fwd_consumers", 2) for c in cfgs] == [3, 2, 2, 2]
    assert [dict(sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, sparse=sp)).get("fwd_consumers", 2)
            for sp in (False, True)] == [3, 2]
    # an explicit two-warpgroup tile at d 64 (no fwd_consumers) stays one
    pp = dict(sm90.config(dense, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_overlap": 1, "fwd_pingpong": 1}))
    assert "fwd_consumers" not in pp and pp["fwd_pingpong"] == 1
    softcap = flashgen.compile(SPECS / "softcap.attn").spec
    assert "fwd_consumers" not in dict(sm90.config(softcap, "sm_90a", ir.DType.BF16, 64))
    # block-sparse instantiations take key tiles that divide 128 (lists of 128-blocks nest)
    assert dict(sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 192))["fwd_block_n"] == 112
    sparse = [dict(sm90.config(causal.spec, "sm_90a", ir.DType.BF16, d, sparse=True)) for d in (128, 136, 256)]
    assert [(c["fwd_block_n"], c["sparse"]) for c in sparse] == [(128, 1), (64, 1), (64, 1)]
    assert sm90.block_tiles(lambda: sparse[2], (128, 128))[:2] == (128, 64)
    for d in range(136, 257, 8):  # the largest fitting key tile beyond d = 128
        bn = sm90_family.default_block_n(d)
        assert sm90_family.smem_bytes(d, bn, 2) <= sm90_family.SMEM_LIMIT < sm90_family.smem_bytes(d, bn + 16, 2)
    inst = sm90.instantiation(causal.spec, "sm_90a", ir.DType.BF16, 128)
    assert inst.kinds == ("fwd", "bwd") and inst.name.startswith("fg_causal_sm90_bf16_hd128_sm_90a_")
    src = next(iter(inst.sources().values()))
    assert "flashgen/sm90/fwd.cuh" in src and "Sm90FwdTile<128, 2, 1, 0, 4096, 128>" in src and "FgFwdTile, false, false>" in src
    # O staging beside the K/V rings where it fits, else in them (sm90/fwd.cuh kOInRing)
    assert not sm90_family.smem_layout(128, 128, 2)[1] and sm90_family.smem_layout(128, 176, 2)[1]
    assert sm90_family.smem_bytes(128, 176, 2) <= sm90_family.SMEM_LIMIT
    with pytest.raises(ValueError, match="fwd_pingpong: .*needs fwd_overlap=1"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 128, tiles={"fwd_pingpong": 1, "fwd_overlap": 0})
    assert sm90_family.tiles_from_text("176x2x1x0x1073741824") == {
        "fwd_block_n": 176, "fwd_stages": 2, "fwd_overlap": 1, "fwd_pingpong": 0, "fwd_persistent": 1 << 30}
    assert sm90_family.tiles_from_text("128x3") == {"fwd_block_n": 128, "fwd_stages": 3}
    assert sm90_family.tiles_from_text("128x2x0x0x0x3")["fwd_consumers"] == 3
    for bad in ("128", "128x2x1x0x0x2x7", "128xtwo"):
        with pytest.raises(ValueError, match="^tiles: expected keys x stages"):
            sm90_family.tiles_from_text(bad)
    # three consumer warpgroups: 192-row query tiles, not for block lists nor ping-pong
    three = sm90.instantiation(causal.spec, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_consumers": 3})
    assert "Sm90FwdTile<128, 2, 0, 0, 4096, 192>" in three.sources()[three.source_name("fwd")]
    assert sm90.block_tiles(lambda: three.config, (128, 128))[0] == 192
    with pytest.raises(ValueError, match="fwd_consumers: block lists take 128-row query tiles"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, sparse=True, tiles={"fwd_consumers": 3})
    with pytest.raises(ValueError, match="fwd_pingpong: ping-pong takes two consumer warpgroups"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_consumers": 3, "fwd_overlap": 1,
                                                                     "fwd_pingpong": 1})
    with pytest.raises(ValueError, match="fwd_consumers: expected 2 or 3"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_consumers": 4})
    with pytest.raises(ValueError, match="fwd_persistent: expected the largest seqlen_k"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_persistent": -1})
    with pytest.raises(ValueError, match="fwd_block_n: expected a multiple of 16"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_block_n": 100})
    with pytest.raises(ValueError, match="fwd_stages"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 64, tiles={"fwd_stages": 5})
    with pytest.raises(ValueError, match="shared memory"):
        sm90.config(causal.spec, "sm_90a", ir.DType.BF16, 128, tiles={"fwd_block_n": 256})
    packed = sm90.instantiation(causal.spec, "sm_90a", ir.DType.BF16, 128, packed=True, sparse=True)
    assert dict(packed.config)["varlen"] == 1 and "FgFwdTile, true, true>" in next(iter(packed.sources().values()))


def test_family_for_says_which_and_why(causal):
    choice = causal.family_for("cpu", torch.float32, 64)
    assert choice.family.name == "cpu" and choice.forced is None
    assert choice.tried == (("sm90", "runs on cuda tensors, not cpu"), ("sm80", "runs on cuda tensors, not cpu"))
    assert ("cpu (the first family that serves the call; sm90 runs on cuda tensors, not cpu; sm80 runs on cuda "
            "tensors, not cpu)") == choice.why()
    call = families.Call("cuda", "sm_75", ir.DType.BF16, 64)
    with pytest.raises(NotImplementedError, match="sm80 needs compute capability 8.0 or newer"):
        families.choose(causal.spec, call)
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, 64, frozenset({"varlen", "dropout"}))
    assert families.choose(causal.spec, call).family.name == "sm90"
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, 64, frozenset({"varlen", "backward"}))
    assert families.choose(causal.spec, call).family.name == "sm90"
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, 64, frozenset({"sparse", "backward"}))
    assert families.choose(causal.spec, call).family.name == "sm90"
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, 64, frozenset({"sparse", "backward"}), deterministic=True)
    assert families.choose(causal.spec, call).family.name == "sm80"


def test_forced_family_never_falls_back(causal, monkeypatch):
    q = torch.randn(1, 2, 16, 32)
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    with pytest.raises(NotImplementedError, match=r"^family sm80 \(FLASHGEN_FAMILY\) cannot serve this call of spec "
                       r"'causal': it runs on cuda tensors, not cpu"):
        causal(q, q, q)
    with pytest.raises(NotImplementedError, match="family sm80"):  # the raw op goes through the same choice
        causal.torch_op(q, q, q, None, False)
    monkeypatch.setenv("FLASHGEN_FAMILY", "cpu")
    assert causal.family_for("cpu", torch.float32, 32).forced == "FLASHGEN_FAMILY"
    monkeypatch.setenv("FLASHGEN_FAMILY", "nope")
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        causal(q, q, q)
    monkeypatch.delenv("FLASHGEN_FAMILY")
    with flashgen.use_family("sm80"):
        with pytest.raises(NotImplementedError, match=r"family sm80 \(flashgen.use_family\)"):
            causal(q, q, q)
        with flashgen.use_family("cpu"):  # the innermost force wins, and is lifted on exit
            assert torch.isfinite(causal(q, q, q)).all()
        with pytest.raises(NotImplementedError):
            causal(q, q, q)
    out = causal(q, q, q)
    ref = flashgen.reference.attention(causal.spec, q.double(), q.double(), q.double())
    assert (out.double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match="unknown kernel family"):
        with flashgen.use_family("sm90x"):
            pass


def test_build_family_argument(causal):
    with pytest.raises(ValueError, match=r"^family: sm80 does not run on cpu \(it runs on cuda tensors\)"):
        causal.build("cpu", family="sm80")
    with pytest.raises(ValueError, match="unknown kernel family"):
        causal.build("cpu", family="gpu")
    insts = causal.build("cpu", [torch.float32], family="cpu")
    assert [i.target.family for i in insts] == ["cpu"]


def test_family_is_in_artifact_names_and_keys(causal):
    cpu = families.get("cpu")
    inst = cpu.instantiation(causal.spec, "test", ir.DType.FP32, None)
    assert inst.name.startswith("fg_causal_cpu_fp32_hdany_test_")
    other = artifact.Instantiation(causal.spec, artifact.Target("cpu2", "test", "cpu"), ir.DType.FP32, None)
    assert other.key != inst.key and other.variant_id() != inst.variant_id()
    sm80 = families.get("sm80").instantiation(causal.spec, "sm_90a", ir.DType.BF16, 64)
    assert sm80.name.startswith("fg_causal_sm80_bf16_hd64_sm_90a_")
    assert dict(sm80.config)["fwd_block_m"] > 0  # the family filled its tiles in


def test_cli_family_option(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    spec = str(SPECS / "causal.attn")
    code = cli.main(["run", spec, "--batch", "1", "--heads", "2", "--seqlen", "64", "--head-dim", "32", "--dtype",
                     "fp32", "--reps", "1", "--family", "sm80"])
    assert code == 2 and "family sm80 (--family) cannot serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", spec, "--family", "sm70"])


@pytest.mark.parametrize("name", ["causal", "alibi", "gemma"])
def test_planned_eager_calls_match_the_full_path(name, monkeypatch):
    """A repeated eager call with the same input metadata launches from its plan (runtime/
    launch.py, ForwardPlan): same output bits as the validated full path, parameter values
    read per call, a new scale or shape a new plan, a misaligned pointer back to the full path."""
    from variant_cases import op as spec_op

    from flashgen.runtime import launch

    monkeypatch.setattr(launch, "poison_outputs", False)  # planned launches skip the NaN fill pass
    op = spec_op(name)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 32, generator=g)
    k, v = torch.randn(2, 2, 56, 32, generator=g), torch.randn(2, 2, 56, 32, generator=g)
    params = {"alibi": {"slopes": torch.rand(4, generator=g)}, "gemma": {"window": 9, "softcap": 20.0}}.get(name, {})
    op.plans.clear()
    full = op(q, k, v, return_lse=True, **params)
    assert len(op.plans) == 1
    calls = []
    real = launch.planned_forward
    monkeypatch.setattr(launch, "planned_forward", lambda *a: calls.append(1) or real(*a))
    again = op(q, k, v, return_lse=True, **params)
    assert calls and torch.equal(full[0], again[0]) and torch.equal(full[1], again[1])
    ref = flashgen.reference.attention(op.spec, q.double(), k.double(), v.double(), **params)
    assert (again[0].double() - ref).abs().max() < 1e-4
    if name == "gemma":  # a scalar parameter's value is read per call, and checked
        other = op(q, k, v, window=3, softcap=20.0)
        ref3 = flashgen.reference.attention(op.spec, q.double(), k.double(), v.double(), window=3, softcap=20.0)
        assert (other.double() - ref3).abs().max() < 1e-4 and len(op.plans) == 1
        with pytest.raises(ValueError, match="softcap"):
            op(q, k, v, window=3, softcap=float("inf"))
    op(q, k, v, scale=0.3, **params)
    assert len(op.plans) == 2
    buf = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)  # a pointer off the 16-byte grid
    assert torch.equal(op(buf, k, v, **params), full[0])


def test_eager_autograd_matches_the_dispatcher_path(monkeypatch):
    """An eager call that records a gradient runs the op's autograd without the dispatcher
    (runtime/library.py, EagerAttention): outputs, LSE and every gradient (q, k, v, a tensor
    parameter, through out and LSE) equal to the registered op's (bit-equal in deterministic
    mode; a tensor parameter's gradient, summed with atomics, to rounding), with dropout, a
    packed batch and a block mask too."""
    from variant_cases import op as spec_op

    from flashgen.runtime import launch

    monkeypatch.setattr(launch, "poison_outputs", False)  # eager calls may launch from plans
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 40, 32, generator=g)
    k, v = torch.randn(2, 2, 56, 32, generator=g), torch.randn(2, 2, 56, 32, generator=g)
    dout, dlse = torch.randn(2, 4, 40, 32, generator=g), torch.randn(2, 4, 40, generator=g)
    alibi, drop, causal = spec_op("alibi"), spec_op("dropout"), spec_op("causal")
    slopes = torch.rand(4, generator=g)
    state = flashgen.dropout_state(3, "cpu")
    mask = flashgen.block_mask(causal, 40, 56, block_size=16)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    cases = [  # (op, eager kwargs, the same call through op.torch_op: extra args, kwargs)
        (alibi, {"slopes": slopes}, (slopes,), {}),
        (drop, {"dropout_p": 0.3, "dropout_seed": 3}, (0.3, state), {}),
        (causal, {"block_mask": mask}, (), None),
        (causal, {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 23, "max_seqlen_k": 23}, (),
         {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 23, "max_seqlen_k": 23}),
    ]
    with torch.no_grad():  # a plan for these inputs' metadata: a call that records a gradient never uses it
        causal(q, k, v)
    cases.append((causal, {}, (), {}))
    for op, kw, extra, torch_kw in cases:
        packed = "cu_seqlens_q" in kw
        x = [torch.randn(40, h, 32, generator=g) for h in (4, 2, 2)] if packed else [q, k, v]
        do, dl = (torch.randn_like(x[0]), torch.randn(x[0].shape[1], 40)) if packed else (dout, dlse)
        runs = []
        for eager in (True, False):
            inputs = [t.clone().requires_grad_() for t in x]
            sl = slopes.clone().requires_grad_() if op is alibi else None
            if eager:
                out, lse = op(*inputs, return_lse=True, deterministic=op is not alibi,
                              **({**kw, "slopes": sl} if sl is not None else kw))
                assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
            else:
                if torch_kw is None:  # a block mask: the op's own lists for these shapes
                    torch_kw = op.block_args(mask, x[0], x[1], False, None, None, None, grad=True)
                out, lse = op.torch_op(*inputs, None, op is not alibi, *((sl,) if sl is not None else extra),
                                       **torch_kw)
                assert type(out.grad_fn).__name__ != "EagerAttentionBackward"
            torch.autograd.backward((out, lse), (do, dl))
            runs.append([out, lse, *(t.grad for t in inputs)] + ([sl.grad] if sl is not None else []))
        for a, b in zip(*runs, strict=True):
            if op is alibi:  # a tensor parameter's gradient is summed with atomics: no deterministic mode
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(a, b)


def test_messages_name_what_forced_the_family(causal, monkeypatch, capsys):
    """Errors say what forced a family (--family, FLASHGEN_FAMILY) and name a bad dtype or an
    unavailable device by their arguments."""
    q = torch.randn(1, 2, 16, 32)
    monkeypatch.setenv("FLASHGEN_FAMILY", "bogus")
    with pytest.raises(ValueError, match="^FLASHGEN_FAMILY: unknown kernel family 'bogus'"):
        causal(q, q, q)
    monkeypatch.delenv("FLASHGEN_FAMILY")
    code = cli.main(["run", str(SPECS / "causal.attn"), "--batch", "1", "--heads", "2", "--seqlen", "32",
                     "--head-dim", "32", "--dtype", "fp32", "--reps", "1", "--family", "sm80"])
    assert code == 2 and "family sm80 (--family) cannot serve" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^dtype: unknown dtype"):
        causal.family_for("cpu", torch.float64, 64)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device: CUDA is not available"):
            causal.family_for("cuda", torch.bfloat16, 128)
    with pytest.raises(ValueError, match="^q: dtype torch.float64 is not supported"):
        causal(q.double(), q, q)


@pytest.mark.parametrize("name", ["sm80", "sm90"])
def test_families_fill_the_gqa_split_of_the_backward_args(causal, name):
    """Each CUDA family's per-call decision for its backward (families/sm80.py, sm90.py):
    FgBwdArgs.gqa_splits from sm80's rule, with the key tile of the library's backward kernel
    (sm90: its 128 keys) and the multiprocessor count; 1 when deterministic (the CUDA launchers
    only read and check it)."""
    from flashgen.abi import FgBwdArgs
    from flashgen.families import sm90 as sm90_mod
    from flashgen.families.sm80 import gqa_splits

    fam = families.get(name)
    inst = fam.instantiation(causal.spec, "sm_90a", ir.DType.BF16, 128)
    block_n = flashgen.tiles.from_config(dict(inst.config))[1].block_n if name == "sm80" else sm90_mod.BWD_BLOCK_N
    fields = fam.launch_fields(causal.spec)
    for batch, hq, hkv, nk, sms, det in ((1, 8, 1, 256, 132, 0), (1, 8, 2, 4096, 132, 0), (2, 6, 2, 1000, 108, 0),
                                         (1, 8, 1, 256, 132, 1), (1, 4, 4, 128, 132, 0)):
        args = FgBwdArgs()
        args.batch, args.heads_q, args.heads_kv, args.seqlen_k, args.num_sms, args.deterministic = \
            batch, hq, hkv, nk, sms, det
        fields.bwd(args, (), inst.config)
        want = 1 if det else gqa_splits(-(-nk // block_n), hkv, batch, hq // hkv, sms)
        assert args.gqa_splits == want >= 1 and (hq // hkv) % want == 0
    # 8 heads on one kv head, 2 key tiles of 128 on 132 SMs: the whole group is split 8 ways.
    assert gqa_splits(2, 1, 1, 8, 132) == 8 and gqa_splits(40, 2, 1, 4, 132) == 1
    if name == "sm80":
        assert not fields.fills_fwd
