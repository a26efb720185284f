"""Grammar, positioned error messages, IR validation and fingerprint invariance."""

import pytest

from flashgen.errors import SpecError
from flashgen.lang import frontend, ir


def parse(text, file="t.attn"):
    return frontend.parse(file, text=text)


def error(text) -> SpecError:
    with pytest.raises(SpecError) as e:
        parse(text)
    return e.value


def test_minimal_specs():
    s = parse("attention dense {\n}\n")
    assert s.name == "dense" and s.mask_kind is ir.MaskKind.NONE
    assert s.head_dims is None and s.dtypes is None and s.scale is None
    assert parse("attention c { mask = causal }").mask_kind is ir.MaskKind.CAUSAL
    assert parse("attention c { mask = causal_top_left }").mask_kind is ir.MaskKind.CAUSAL_TOP_LEFT
    assert parse("attention n {\n mask = none\n}").mask_kind is ir.MaskKind.NONE


def test_restricting_lines():
    s = parse("attention x {\n  head_dim 128, 64\n  dtype bfloat16, fp16\n  scale = 0.5 * 2 / sqrt(head_dim)\n}")
    assert s.head_dims == (64, 128)
    assert s.dtypes == (ir.DType.BF16, ir.DType.FP16)
    assert frontend.evaluate_scale(s.scale, 64) == pytest.approx(1 / 8)


def test_grammar_takes_later_features_syntax():
    """Mask/score expressions, typed params, dropout, block sizes parse (block_size's lowering says
    'not yet')."""
    tree = frontend._parser().parse(
        "attention alibi {\n"
        "    param slopes: f32[heads]\n"
        "    param window: i32\n"
        "    score = score + slopes[h] * (kv - q - (seqlen_k - seqlen_q))\n"
        "    mask = causal and not (kv < q - window) or where(q > 1, kv >= 0, kv < 0)\n"
        "    dropout\n"
        "    block_size 128\n"
        "}\n"
    )
    kinds = [c.data for c in tree.children[0].children[1:]]
    assert kinds == ["param_stmt", "param_stmt", "score_stmt", "mask_stmt", "dropout_stmt", "block_size_stmt"]


def test_fingerprint_ignores_formatting_and_comments():
    a = parse("attention c {\n    mask = causal   # the mask\n    head_dim 64\n}\n")
    b = parse("# header comment\n\nattention c { head_dim 64; mask=causal }", file="other.attn")
    assert a == b
    assert a.fingerprint() == b.fingerprint()
    assert a.span != b.span  # spans differ but do not count


def test_fingerprint_changes_with_semantics():
    base = parse("attention c { mask = causal }").fingerprint()
    assert parse("attention c { mask = causal_top_left }").fingerprint() != base
    assert parse("attention d { mask = causal }").fingerprint() != base
    assert parse("attention c { mask = causal; head_dim 64 }").fingerprint() != base
    assert parse("attention c { mask = causal; scale = 0.1 }").fingerprint() != base


def test_ir_is_frozen():
    s = parse("attention c { mask = causal }")
    with pytest.raises(AttributeError):
        s.name = "x"


def test_unknown_statement_position_and_suggestion():
    e = error("attention x {\n    maks = causal\n}\n")
    assert (e.file, e.line, e.column) == ("t.attn", 2, 5)
    text = str(e)
    assert text.startswith("t.attn:2:5: error: unknown statement 'maks'")
    assert "    maks = causal\n" in text
    assert "\n        ^\n" in text  # caret under column 5 (after the 4-space gutter)
    assert "did you mean 'mask'?" in text


def test_reserved_statement_is_refused_and_never_offered():
    """block_size is reserved by the grammar for a later version: writing it says so, and no
    error's list of what was expected offers it."""
    e = error("attention x {\n  block_size 64\n}\n")
    assert (e.line, e.column) == (2, 3) and "'block_size' is not supported in this version" in str(e)
    for text in ("attention x {\n  foo\n}\n", "attention x {\n  mask = causal\n", "attention x {\n  blok_size 4\n}"):
        e = error(text)
        assert e.expected and "dropout" in e.expected and "block_size" not in e.expected, (text, e.expected)


def test_unknown_mask_suggestion():
    e = error("attention x {\n  mask = casual\n}")
    assert (e.line, e.column) == (2, 10)
    assert "unknown mask 'casual'" in str(e) and "did you mean 'causal'?" in str(e)
    assert "one of none, causal, causal_top_left" in str(e)


def test_syntax_error_expected_tokens():
    e = error("attention x {\n  mask = causal +\n}")
    assert (e.line, e.column) == (2, 18)
    assert "unexpected end of line" in str(e)
    assert "a name" in e.expected and "a number" in e.expected


def test_missing_name_and_eof():
    e = error("attention { }")
    assert (e.line, e.column) == (1, 11) and e.expected == "a name"
    e = error("attention x {\n  mask = causal\n")
    assert "unexpected end of file" in str(e) and "'}'" in e.expected


def test_bad_character():
    e = error("attention x {\n  mask = causal $\n}")
    assert (e.line, e.column) == (2, 17) and "unexpected character '$'" in str(e)


@pytest.mark.parametrize(
    "body, line, col, message",
    [
        ("head_dim 65", 2, 12, "head_dim 65 is not supported"),
        ("head_dim 512", 2, 12, "head_dim 512 is not supported"),
        ("head_dim 64, 64", 2, 16, "head_dim 64 is listed twice"),
        ("dtype bf17", 2, 9, "unknown dtype 'bf17'"),
        # a list names each entry once (head_dim and dtype are the list-valued lines)
        ("dtype bf16, bf16", 2, 15, "dtype bf16 is listed twice"),
        ("dtype fp16, bf16, fp16", 2, 21, "dtype fp16 is listed twice"),
        ("dtype bf16, fp16, bfloat16", 2, 21, "dtype bfloat16 is listed twice (as 'bf16')"),
        ("dtype fp32,float", 2, 14, "dtype float is listed twice (as 'fp32')"),
        ("head_dim 64, 128, 64", 2, 21, "head_dim 64 is listed twice"),
        ("mask = q >= kv + score", 2, 20, "'score' can only be used in a score expression"),
        ("mask = kv + 1", 2, 10, "mask must be a condition"),
        ("mask = kv < windw", 2, 15, "unknown name 'windw'"),
        ("mask = kv <= q and 3", 2, 22, "'and' needs boolean operands"),
        ("mask = kv % 2.5 < q", 2, 10, "'%' needs integers"),
        ("mask = window(1)", 2, 10, "window() takes 2 argument(s), got 1"),
        ("score = score * 2 > 1", 2, 11, "score must be a number, got a condition"),
        ("score = tanhh(score)", 2, 11, "unknown function 'tanhh'"),
        ("score = score + slopes[h]", 2, 19, "unknown name 'slopes'"),
        ("param p: f32", 2, 12, "tensor parameter 'p' needs a shape"),
        ("param p: f33[heads]", 2, 12, "unknown parameter type 'f33'"),
        ("param p: f32[heads, sequence]", 2, 23, "unknown dimension 'sequence'"),
        ("param q: int", 2, 9, "'q' is a reserved name"),
        ("param dropout_offset: int", 2, 9, "'dropout_offset' cannot name a parameter"),
        ("param lowp_matmuls: int", 2, 9, "'lowp_matmuls' cannot name a parameter"),
        # flashgen.block_mask's own keywords (it takes the spec's parameters by keyword too)
        ("param block_size: int", 2, 9, "'block_size' cannot name a parameter"),
        ("param device: int", 2, 9, "'device' cannot name a parameter"),
        ("param op: int", 2, 9, "'op' cannot name a parameter"),
        ("param NAN: float", 2, 9, "'NAN' cannot name a parameter (it is, or looks like, a C/C++ macro"),
        ("param errno: int", 2, 9, "'errno' cannot name a parameter (it is, or looks like, a C/C++ macro"),
        ("param w: int[heads]", 2, 15, "scalar parameter 'w' (int) takes no shape"),
        ("param p: f32[batch|2]", 2, 22, "only '|1' is allowed"),
        ("param p: f32[heads, 2 * m]\n  param m: int", 2, 27, "dimension uses parameter 'm' before its declaration"),
        ("param p: f32[heads, -3]", 2, 23, "dimension is not positive"),
        ("mask = kv % 0 == 1", 2, 10, "division by zero"),
        ("score = score + 1e39", 2, 19, "beyond fp32's range"),
        ("score = score + 1e30 * 1e30 * 0", 2, 19, "this constant is 1e+60, beyond fp32's range"),
        # the mask built-ins' arguments, checked before expansion and pointed at
        ("mask = window(true, 2)", 2, 17, "window()'s first argument must be a number"),
        ("mask = window(2, q < kv)", 2, 20, "window()'s second argument must be a number"),
        ("param n: int\n  mask = document(n)", 3, 19, "document()'s argument must name a tensor parameter"),
        ("dropout\n  dropout", 3, 3, "duplicate 'dropout' statement (first on line 2)"),
        ("scale = 1 / sqrt(head_dmi)", 2, 20, "unknown name 'head_dmi' in scale"),
        ("scale = sqrtt(head_dim)", 2, 11, "unknown function 'sqrtt' in scale"),
        ("scale = 1 / 0", 2, 11, "division by zero in scale"),
        ("scale = -1", 2, 11, "scale must be a positive finite number"),
        ("scale = 1e38 * 10", 2, 11, "scale is 1e+39 at head_dim 64, beyond fp32's range"),
    ],
)
def test_validation_errors(body, line, col, message):
    e = error(f"attention x {{\n  {body}\n}}\n")
    assert (e.line, e.column) == (line, col), str(e)
    assert message in str(e)
    assert str(e).startswith(f"t.attn:{line}:{col}: error:")


def test_duplicate_statement():
    e = error("attention x {\n  mask = causal\n  mask = none\n}")
    assert (e.line, e.column) == (3, 3) and "first on line 2" in str(e)


def test_dropout_declaration_enters_the_fingerprint():
    base = frontend.parse("attention c { mask = causal }")
    spec = frontend.parse("attention c {\n  mask = causal\n  dropout\n}")
    assert spec.dropout and not base.dropout
    assert spec.fingerprint() != base.fingerprint()
    assert frontend.parse("attention c { dropout; mask = causal }").fingerprint() == spec.fingerprint()


def test_did_you_mean_for_scale_name():
    assert "did you mean 'head_dim'?" in str(error("attention x {\n scale = 1/head_dmi\n}"))


def test_parse_from_path(tmp_path):
    p = tmp_path / "w.attn"
    p.write_text("attention w {\n  mask = causl\n}\n")
    with pytest.raises(SpecError) as e:
        frontend.parse(p)
    assert str(e.value).startswith(f"{p}:2:10: error:")
    with pytest.raises(FileNotFoundError):
        frontend.parse(tmp_path / "missing.attn")


def test_example_specs_parse():
    from conftest import SPECS

    dense = frontend.parse(SPECS / "dense.attn")
    causal = frontend.parse(SPECS / "causal.attn")
    assert dense.mask_kind is ir.MaskKind.NONE and causal.mask_kind is ir.MaskKind.CAUSAL
    for s in (dense, causal):  # the examples restrict nothing
        assert s.head_dims is None and s.dtypes is None


def test_chained_comparison_hint():
    e = error("attention x {\n  mask = 0 <= kv <= q\n}\n")
    assert (e.line, e.column) == (2, 18), str(e)
    assert "comparisons do not chain" in str(e)


def test_caret_follows_tabs():
    e = error("attention x {\n\tmask = kv < windw\n}\n")
    lines = str(e).splitlines()
    assert lines[1] == "    \tmask = kv < windw"
    assert lines[2] == "    \t" + " " * (e.column - 2) + "^"


def test_fingerprint_and_mask_facts_are_computed_once_per_spec(monkeypatch):
    """Spec.fingerprint (a sha256 of the canonical dump, ~0.5 ms) and the mask facts block masks
    ask for are computed once per Spec object, and equal specs give equal fingerprints."""
    from flashgen import sparsity
    from flashgen.lang import ir

    text = "attention d { param doc: i32[batch, seqlen_k]\n mask = doc[b, q] == doc[b, kv] }"
    spec = frontend.parse(text)
    calls = []
    real = ir.canonical_json
    monkeypatch.setattr(ir, "canonical_json", lambda s: calls.append(1) or real(s))
    fp = spec.fingerprint()
    assert spec.fingerprint() == fp and len(calls) == 1
    assert frontend.parse(text).fingerprint() == fp and len(calls) == 2  # another object: its own dump
    assert frontend.parse(text.replace("==", "!=")).fingerprint() != fp
    assert sparsity.mask_extents(spec) == (True, False) and sparsity.mask_extents(spec) == (True, False)
    assert sparsity.mask_has_float(spec) is False and spec.__dict__["_mask_has_float"] is False
