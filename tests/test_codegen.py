"""Rendering, generated/ staleness, strict templates, cache keys."""

import shutil

import pytest
from conftest import ROOT, SPECS

from flashgen import families, paths, tiles
from flashgen.build import artifact
from flashgen.codegen import render
from flashgen.lang import frontend, ir
from flashgen.tools import generate


@pytest.mark.parametrize("spec", sorted(SPECS.glob("*.attn")), ids=lambda p: p.stem)
def test_every_spec_renders(spec):
    files = generate.generated_files(spec.relative_to(ROOT))
    name = frontend.parse(spec).name
    assert {"cpu_fwd_fp32.cpp", "cpu_bwd_bf16.cpp", "cuda_fwd_bf16_hd128.cu", "cuda_bwd_fp16_hd64.cu"} <= set(files)
    for fname, text in files.items():
        # every generated file names itself: spec, fingerprint, family
        assert f"// spec:        {name} (specs/{spec.name}:" in text
        assert frontend.parse(spec).fingerprint()[:12] in text
        assert "extern \"C\" int fg_" in text
        assert "{{" not in text and "{%" not in text


def test_generated_is_up_to_date(tmp_path, monkeypatch):
    """generated/ must equal a fresh render: run `flashgen generate specs/*.attn` after edits."""
    monkeypatch.chdir(ROOT)
    specs = sorted(p.relative_to(ROOT) for p in SPECS.glob("*.attn"))
    generate.generate(specs, tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(ROOT / "generated") for p in (ROOT / "generated").rglob("*") if p.is_file())
    assert fresh == committed, "generated/ is stale: run `python -m flashgen generate specs/*.attn`"
    for rel in fresh:
        assert (tmp_path / rel).read_text() == (ROOT / "generated" / rel).read_text(), f"generated/{rel} is stale"


def test_generate_writes_only_changes(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = [SPECS.relative_to(ROOT) / "causal.attn"]
    assert generate.generate(spec, tmp_path)
    assert generate.generate(spec, tmp_path) == []


def test_hooks_follow_mask():
    dense = frontend.parse("attention d {}")
    causal = frontend.parse("attention c { mask = causal }")
    tl = frontend.parse("attention t { mask = causal_top_left }")
    unit = lambda s: render.render_instantiation(s, "cpu", "fwd", ir.DType.FP32, None, "fg_x", {})  # noqa: E731
    assert "kHasMask = false" in unit(dense)
    # positions are < 2^30, so the element mask is exact in 32-bit ints (expr.Cxx.narrow)
    assert "return (kv <= (q + (seqlen_k - seqlen_q)));" in unit(causal)
    assert "return (kv <= q);" in unit(tl)
    assert "kRowExact = true" in unit(causal)
    # the causal key range of a query tile ends after its last row's diagonal
    assert "fg_clamp_kv(((((fg_int)q_hi - 1) + ((fg_int)seqlen_k - (fg_int)seqlen_q)) + 1), seqlen_k)" in unit(causal)


def test_strict_undefined_names_template():
    import jinja2

    env = render.environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(RuntimeError, match="variant.h.jinja"):
        render.render("variant.h.jinja")  # no context: every name undefined


def _inst(text, **kw):
    spec = frontend.parse("t.attn", text=text)
    return families.get("cpu").instantiation(spec, "test", kw.get("dtype", ir.DType.FP32), None)


def test_key_ignores_spec_formatting():
    a = _inst("attention c {\n  mask = causal # x\n}")
    b = _inst("attention c { mask=causal }")
    assert a.key == b.key and a.name == b.name


def test_key_changes_with_semantics_and_dtype():
    a = _inst("attention c { mask = causal }")
    assert _inst("attention c { mask = none }").key != a.key
    assert _inst("attention c { mask = causal }", dtype=ir.DType.BF16).key != a.key


def test_key_changes_with_a_template_edit(tmp_path, monkeypatch):
    before = _inst("attention c { mask = causal }").key
    copy = tmp_path / "templates"
    shutil.copytree(paths.templates_dir(), copy)
    (copy / "variant.h.jinja").write_text((copy / "variant.h.jinja").read_text() + "\n// edited\n")
    monkeypatch.setattr(paths, "templates_dir", lambda: copy)
    monkeypatch.setattr(artifact, "templates_dir", lambda: copy)
    artifact.generator_hash.cache_clear()
    try:
        assert _inst("attention c { mask = causal }").key != before
        # a CPU kernel header edit leaves the CUDA family's keys alone
        cuda_before = artifact.generator_hash("cuda")
        header = copy / "include" / "flashgen" / "cpu" / "fwd.h"
        header.write_text(header.read_text() + "\n// edited\n")
        artifact.generator_hash.cache_clear()
        assert artifact.generator_hash("cuda") == cuda_before
        # every CUDA family's headers are in the CUDA keys: an sm90 header edit changes them
        cpu_before = artifact.generator_hash("cpu")
        header = copy / "include" / "flashgen" / "sm90" / "fwd.cuh"
        header.write_text(header.read_text() + "\n// edited\n")
        artifact.generator_hash.cache_clear()
        assert artifact.generator_hash("cuda") != cuda_before and artifact.generator_hash("cpu") == cpu_before
    finally:
        artifact.generator_hash.cache_clear()


def test_key_covers_every_emitter_module(tmp_path, monkeypatch):
    """The generator hash covers every module the code generator imports (lang/expr.py emits each
    hook's C++): an edit to one in a copy of the package changes the key; the copy unedited
    does not."""
    names = [m for m, _ in artifact.generator_modules()]
    for must in ("flashgen.codegen.render", "flashgen.codegen.variant", "flashgen.lang.expr", "flashgen.lang.ir",
                 "flashgen.lang.keyrange", "flashgen.abi", "flashgen.build.artifact", "flashgen.build.cache"):
        assert must in names, names
    before = _inst("attention c { mask = causal }").key
    copy = tmp_path / "flashgen"
    shutil.copytree(artifact.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(artifact, "PACKAGE", copy)
    artifact.generator_hash.cache_clear()
    try:
        assert _inst("attention c { mask = causal }").key == before  # same content, same key
        emitter = copy / "lang" / "expr.py"
        emitter.write_text(emitter.read_text() + "\n# an emitter change\n")
        artifact.generator_hash.cache_clear()
        assert _inst("attention c { mask = causal }").key != before
    finally:
        artifact.generator_hash.cache_clear()


def test_artifact_names_are_readable():
    inst = families.get("sm80").instantiation(frontend.parse("attention causal { mask = causal }"), "sm_90a",
                               ir.DType.BF16, 128)
    assert inst.name.startswith("fg_causal_sm80_bf16_hd128_sm_90a_") and len(inst.name.rsplit("_", 1)[1]) == 12
    assert inst.symbol("fwd") == "fg_causal_fwd_bf16_hd128" and inst.symbol("bwd") == "fg_causal_bwd_bf16_hd128"


def test_abi_version_matches_header():
    """ABI_VERSION is read from args.h (FG_ABI_VERSION): one source, no second literal in Python."""
    import inspect
    import re

    from flashgen import abi
    from flashgen.paths import include_dir

    header = (include_dir() / "flashgen" / "args.h").read_text()
    want = int(re.search(r"#define FG_ABI_VERSION (\d+)", header).group(1))
    assert abi.header_constants()["FG_ABI_VERSION"] == abi.ABI_VERSION == want
    assert not re.search(r"ABI_VERSION\b[^=\n]*=\s*\d", inspect.getsource(abi))
    assert abi.status_name(0) == "FG_OK"


def test_tile_overrides_reach_the_cuda_entry_points(monkeypatch):
    """FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE become the instantiation's config (its own
    cache key) and the rendered entry points launch exactly that tile; malformed values raise."""
    from flashgen import env

    spec = frontend.parse("attention c { mask = causal }")
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "128x32x4")
    monkeypatch.setenv("FLASHGEN_CUDA_BWD_TILE", "64x8x1x2")
    config = env.cuda_fwd_tile() + env.cuda_bwd_tile()
    assert dict(config) == {"fwd_block_m": 128, "fwd_block_n": 32, "fwd_warps": 4, "bwd_block_m": 64,
                            "bwd_warps": 8, "bwd_warps_d": 1, "bwd_warps_mdq": 2}
    sm80 = families.get("sm80")
    plain = sm80.instantiation(spec, "sm_90a", ir.DType.BF16, 128)
    tuned = sm80.instantiation(spec, "sm_90a", ir.DType.BF16, 128, tiles=dict(config))
    assert plain.key != tuned.key
    src = tuned.sources()
    fwd = next(v for k, v in src.items() if "fwd" in k)
    bwd = next(v for k, v in src.items() if "bwd" in k)
    assert "launch_fwd_tiled<Variant_c, __nv_bfloat16, 128, FgFwdTile>" in fwd and "FwdTile<128, 32, 4>" in fwd
    assert "BwdTile<64, 8, 1, 2>" in bwd and "launch_bwd_tiled<" in bwd
    # Without an override the instantiation names the table's tiles (flashgen/tiles.py) itself.
    plain_fwd = next(v for k, v in plain.sources().items() if "fwd" in k)
    assert dict(plain.config)["fwd_block_n"] == 64 and "FwdTile<128, 64, 4>" in plain_fwd
    for var, bad in (("FLASHGEN_CUDA_FWD_TILE", "128x64"), ("FLASHGEN_CUDA_FWD_TILE", "128x60x4"),
                     ("FLASHGEN_CUDA_BWD_TILE", "64x8x3x1"), ("FLASHGEN_CUDA_BWD_TILE", "a")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):  # malformed: env; illegal: the tile rules
            tiles.forced("fwd" if "FWD" in var else "bwd")
        monkeypatch.delenv(var)
