"""What a new user meets first: spec checks (literal indices out of range, expressions nested too
deeply, text that is not a spec), the command line's messages and help, autocast, a block mask
under torch.compile without warnings, and the package's declared dependencies."""

import dataclasses
import importlib.metadata
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.cpp_extension as ce

import flashgen
from flashgen import explain as ex
from flashgen.cli import main
from flashgen.errors import SpecError
from flashgen.lang import frontend

SPECS = Path(__file__).resolve().parent.parent / "specs"

# ------------------------------------------------------------------ spec checks


@pytest.mark.parametrize("decl, index, bad, message", [
    ("f32[heads]", "t[-1]", "-1", "index -1 is outside dimension 0 of 't' (indices start at 0)"),
    ("f32[4]", "t[4]", "4", "index 4 is outside dimension 0 of 't', which has size 4"),
    ("f32[heads, 6]", "t[h, 6]", "6", "index 6 is outside dimension 1 of 't', which has size 6"),
])
def test_literal_index_out_of_range_is_a_spec_error(decl, index, bad, message):
    """The kernels would clamp such an index: a spec bug the frontend can see."""
    text = f"attention lit {{\n    param t: {decl}\n    score = score + {index}\n}}\n"
    with pytest.raises(SpecError) as e:
        frontend.parse(text)
    line = text.splitlines()[2]
    col = line.index(index) + index.rindex(bad) + 1
    assert str(e.value).startswith(f"<spec>:3:{col}: error: {message}")


def test_literal_index_in_range_is_accepted():
    frontend.parse("attention lit {\n    param t: f32[4, heads]\n    score = score + t[3, 0]\n}\n")


def test_expression_too_deep_is_a_spec_error_at_its_position():
    terms = " + ".join(["q"] * 3000)
    with pytest.raises(SpecError) as e:
        frontend.parse(f"attention deep {{\n    score = score + {terms}\n}}\n")
    assert str(e.value).startswith("<spec>:2:13: error: expression nests 3000 levels deep")
    assert f"at most {frontend.MAX_DEPTH} levels" in str(e.value)
    ok = " + ".join(["q"] * (frontend.MAX_DEPTH - 1))
    frontend.parse(f"attention deep {{\n    score = score + {ok}\n}}\n")


def test_text_that_is_not_a_spec_is_not_reported_as_a_missing_file(tmp_path):
    with pytest.raises(SpecError) as e:
        flashgen.compile("hello world")
    text = str(e.value)
    assert text.startswith("<spec>:1:1: error: unexpected 'hello'")
    assert "no file named 'hello world' exists, so it was read as spec text" in text
    with pytest.raises(FileNotFoundError, match="no such file"):
        flashgen.compile(str(tmp_path / "missing.attn"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        flashgen.compile("missing.attn")


# ------------------------------------------------------------------ the command line

INDEXED = "attention indexed {\n    param idx: i32[heads]\n    param t: f32[8]\n    score = score + t[idx[h]]\n}\n"


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_with_random_int_tensor_used_as_an_index_is_one_line(capsys, tmp_path, monkeypatch):
    spec = tmp_path / "indexed.attn"
    spec.write_text(INDEXED)
    monkeypatch.setattr(ce, "load", lambda *a, **k: pytest.fail("a kernel was built for parameters out of range"))
    rc, _, err = cli(capsys, "run", str(spec), "--seqlen", "32", "--dtype", "fp32")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("flashgen: error: ValueError: --param: t: index 0 of t[...] reaches")
    assert "the values of idx were drawn at random" in err and "--param idx=N" in err


def test_unknown_or_unavailable_bench_peers_are_errors(capsys):
    spec = str(SPECS / "causal.attn")
    rc, _, err = cli(capsys, "bench", spec, "--peers", "sdpa", "spda")
    assert rc == 2 and "--peers: unknown peer 'spda' (the peers on cpu: sdpa, eager); did you mean 'sdpa'?" in err
    rc, _, err = cli(capsys, "bench", spec, "--peers", "flex")
    assert rc == 2 and "--peers: peer 'flex' runs on cuda, not cpu" in err
    rc, _, err = cli(capsys, "bench", str(SPECS / "dropout.attn"), "--peers", "eager", "--dropout-p", "0.1")
    assert rc == 2 and "--peers: peer 'eager' has no dropout" in err


def test_run_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for option, default in (("--batch", "2"), ("--heads", "8"), ("--seqlen", "1024"), ("--head-dim", "64"),
                            ("--dtype", "bf16"), ("--device", "cpu"), ("--reps", "10"), ("--dropout-p", "0.0")):
        assert re.search(rf"{option} \S+ .*?\(default: {re.escape(default)}\)", out), (option, out)


@pytest.mark.parametrize("command", ["run", "bench", "build"])
def test_unknown_device_names_the_option_not_torchs_device_list(capsys, command):
    rc, _, err = cli(capsys, command, str(SPECS / "causal.attn"), "--device", "gpu")
    assert rc == 2 and "Expected one of" not in err
    assert "--device gpu: not a device; expected cpu or cuda[:N] (did you mean cuda?)" in err


def test_explain_says_how_far_the_measurement_is_from_the_floor(capsys):
    rep = ex.explain(SPECS / "causal.attn", 256, head_dim=64, dtype="fp32", device="cpu")
    rep = dataclasses.replace(rep, measured_ms=rep.floor_ms / 0.713, tflops=1.0, fraction_of_floor=0.713)
    ex.render(rep)
    out = " ".join(capsys.readouterr().out.split())
    assert "1.40× the floor (the floor is 71.3% of the measured time)" in out
    assert "71.3% of the floor" not in out


# ------------------------------------------------------------------ autocast


def autocast_case(device, dtype):
    op = flashgen.compile(SPECS / "alibi.attn")
    g = torch.Generator(device=device).manual_seed(3)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=g, device=device) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], device=device)  # an f32 parameter: it stays f32 under autocast
    with torch.autocast(device, dtype=dtype):
        out, lse = op(q, k, v, return_lse=True, slopes=slopes)
        sdpa = F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == sdpa.dtype == dtype and lse.dtype == torch.float32
    want, want_lse = op(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True, slopes=slopes)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    q.requires_grad_()
    with torch.autocast(device, dtype=dtype):
        out = op(q, k, v, slopes=slopes)
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    qd = q.detach().to(dtype).requires_grad_()
    (want_dq,) = torch.autograd.grad(op(qd, k.to(dtype), v.to(dtype), slopes=slopes).float().sum(), qd)
    assert dq.dtype == torch.float32 and torch.equal(dq, want_dq.float())
    fn = torch.compile(lambda q, k, v: op(q, k, v, slopes=slopes), fullgraph=True, backend="aot_eager")
    with torch.autocast(device, dtype=dtype):
        assert torch.equal(fn(q.detach(), k, v), want)


def test_cpu_autocast_computes_in_the_autocast_dtype():
    """As SDPA: under torch.autocast the op casts q, k, v and returns the autocast dtype."""
    autocast_case("cpu", torch.bfloat16)


@pytest.mark.gpu
def test_cuda_autocast_computes_in_the_autocast_dtype():
    autocast_case("cuda", torch.float16)


# ------------------------------------------------------------------ torch.compile


def test_block_mask_under_torch_compile_prints_no_dynamo_warning():
    """Dynamo warned (8 lines) about a functools cache called while checking a mask's binding."""
    from torch._dynamo.utils import warn_once_cache

    op = flashgen.compile(SPECS / "causal.attn")
    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    bm = flashgen.block_mask(op, 128, 128, block_size=32)
    for seen in [m for m in warn_once_cache if "lru_cache" in m]:  # warned once per process
        warn_once_cache.discard(seen)
    fn = torch.compile(lambda x, m: op(x, x, x, block_mask=m), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(q, bm)
        out.sum().backward()
    assert torch.equal(out, op(q, q, q, block_mask=bm))
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message)]


# ------------------------------------------------------------------ packaging


def test_numpy_is_a_declared_dependency():
    """torch warns "Failed to initialize NumPy" at import without numpy, on every command."""
    requires = importlib.metadata.requires("flashgen") or []
    assert any(re.match(r"numpy\b", r) for r in requires), requires
    tomllib = pytest.importorskip("tomllib")  # the checkout's own pyproject.toml, not the installed metadata
    project = tomllib.loads((SPECS.parent / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"numpy\b", r) for r in project["dependencies"]), project["dependencies"]


def test_a_long_spec_line_is_shown_as_a_window_around_the_error():
    with pytest.raises(SpecError) as err:
        flashgen.compile("attention a {\n score = " + " + ".join(["score"] * 3000) + "\n}")
    text = str(err.value)
    assert len(text) < 600, len(text)
    shown, caret = text.splitlines()[1:3]
    assert shown.endswith("…") and caret.strip() == "^" and shown[caret.index("^")] == "s"


def test_numpy_scalars_are_accepted_as_int_and_float_parameters():
    np = pytest.importorskip("numpy")
    op = flashgen.compile("specs/gemma.attn")  # window: int, softcap: float (built by other tests too)
    q = torch.randn(1, 2, 9, 32)
    want = op(q, q, q, window=3, softcap=20.0)
    assert torch.equal(op(q, q, q, window=np.int64(3), softcap=np.float32(20.0)), want)


def test_a_broadcast_dim_of_size_one_is_not_offered_twice():
    op = flashgen.compile("specs/bias.attn")
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match=r"^bias: dim 0 has size 2, expected 1 \(\["):
        op(q, q, q, bias=torch.zeros(2, 1, 16, 16))


# ------------------------------------------------------------------ bad input at the edges of the API
# (each found by trying to break the API as a new user: the errors came from inside, or no error
# came and the result was wrong)


def _op(name):
    return flashgen.compile(SPECS / f"{name}.attn")


def test_a_meta_tensor_beside_real_ones_is_an_error_not_uninitialised_output():
    """The dispatcher sends a call with one tensor on the meta device to the op's fake kernel even
    when q is real; it returned empty (uninitialised) out and lse. Every op names the argument."""
    alibi, causal = _op("alibi"), _op("causal")
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    slopes = torch.rand(2)
    with pytest.raises(ValueError, match="slopes: on meta but q is on cpu"):
        alibi.torch_op(q, k, v, None, False, slopes.to("meta"))
    with pytest.raises(ValueError, match="k: on meta but q is on cpu"):
        causal.torch_op(q, k.to("meta"), v, None, False)
    out, lse = causal.torch_op(q, k, v, None, False)
    bwd = getattr(torch.ops.flashgen, causal.torch_op.name().split("::")[1] + "_bwd")
    for i, name in ((3, "out"), (4, "lse"), (5, "dout")):
        args = [q, k, v, out, lse, torch.ones_like(out), None, None, False, []]
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError, match=f"{name}: on meta but q is on cpu"):
            bwd(*args)
    with pytest.raises(ValueError, match="cache_seqlens: on meta but q is on cpu"):
        causal.torch_kvcache(q[:, :, :1], k, v, torch.full((1,), 4, dtype=torch.int32, device="meta"),
                             None, None, None, None, None, 0)
    # every tensor on meta is a shape computation, as before
    out, lse = causal.torch_op(q.to("meta"), k.to("meta"), v.to("meta"), None, False)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == q.shape[:3]


def test_kvcache_writing_into_one_cache_tensor_twice_is_refused_on_every_call():
    """v_cache that is k_cache's memory, with k / v to append, is refused also after a call of
    the same metadata (whose validation is remembered): the append would write v over k."""
    op = _op("causal")
    q = torch.randn(1, 2, 1, 16)
    kc, vc = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16)
    kn, vn = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    lens = torch.full((1,), 4, dtype=torch.int32)
    op.with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=vn)  # the metadata, validated once
    shared = torch.zeros(1, 2, 16, 16)
    with pytest.raises(ValueError, match="v_cache: is k_cache's memory"):
        op.with_kvcache(q, shared, shared, cache_seqlens=lens, k=kn, v=vn)
    assert not shared.any()


def test_non_tensor_k_or_v_is_a_short_type_error():
    op = _op("causal")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match=r"^k: expected a torch.Tensor, got ndarray$"):
        op(q, q.numpy(), q)
    with pytest.raises(TypeError, match=r"^v: expected a torch.Tensor, got list$"):
        op(q, q, q.tolist())


@pytest.mark.parametrize("call", ["block_mask", "build", "dropout_state", "block_mask_to"])
def test_unknown_device_strings_are_value_errors_naming_device(call):
    op = _op("causal")
    with pytest.raises(ValueError, match="device: unknown device 'gpu'"):
        if call == "block_mask":
            flashgen.block_mask(op, 64, 64, device="gpu")
        elif call == "build":
            op.build("gpu")
        elif call == "dropout_state":
            flashgen.dropout_state(None, "gpu")
        else:
            flashgen.block_mask(op, 64, 64).to("gpu")


def test_block_mask_to_an_unsupported_device_names_device():
    with pytest.raises(ValueError, match="device: 'meta' is not supported"):
        flashgen.block_mask(_op("causal"), 64, 64).to("meta")


def test_merge_attention_names_a_non_sequence_argument():
    o, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    with pytest.raises(TypeError, match="outs: expected a list or tuple of tensors"):
        flashgen.merge_attention(None, None)
    with pytest.raises(TypeError, match="lses: expected a list or tuple of tensors"):
        flashgen.merge_attention([o], 1.0)
    out, _ = flashgen.merge_attention((x for x in [o]), iter([lse]))  # any iterable still works
    assert torch.equal(out, o)


def test_reference_with_zero_heads_is_empty_as_the_op():
    op = _op("causal")
    q = torch.randn(2, 0, 8, 16, dtype=torch.float64)
    out, lse = flashgen.reference.attention(op, q, q, q, return_lse=True)
    assert out.shape == (2, 0, 8, 16) and lse.shape == (2, 0, 8)
    assert op(q.float(), q.float(), q.float()).shape == out.shape


def test_kvcache_takes_numpy_scalars_as_op_does():
    np = pytest.importorskip("numpy")
    op = _op("causal")
    q, kc = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 32, 16)
    lens = torch.full((1,), 20, dtype=torch.int32)
    ref = op.with_kvcache(q, kc, kc, cache_seqlens=lens, scale=0.1, num_splits=2)
    got = op.with_kvcache(q, kc, kc, cache_seqlens=lens, scale=np.float32(0.1), num_splits=np.int64(2))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_raw_backward_op_refuses_deterministic_parameter_gradients():
    """The raw backward op asked for a parameter gradient (fp32 atomics) in deterministic mode
    refuses as the op's autograd backward does (it returned the non-repeatable gradient)."""
    op = _op("alibi")
    q, slopes = torch.randn(1, 2, 8, 16), torch.rand(2)
    out, lse = op.torch_op(q, q, q, None, False, slopes)
    bwd = getattr(torch.ops.flashgen, op.torch_op.name().split("::")[1] + "_bwd")
    with pytest.raises(RuntimeError, match="slopes are summed with fp32 atomics"):
        bwd(q, q, q, out, lse, torch.ones_like(out), None, None, True, slopes, [True])
    dq = bwd(q, q, q, out, lse, torch.ones_like(out), None, None, True, slopes, [False])[0]
    assert torch.isfinite(dq).all()


def test_bool_for_an_int_parameter_is_refused_compiled_and_in_with_kvcache():
    """A bool where the spec declares an int or float: the torch op's schema would take it as 0
    or 1, so op(...) refuses it before the op, also under torch.compile and in with_kvcache."""
    op = _op("sliding_window")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="window: expected an int, got bool"):
        op(q, q, q, window=True)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="window: expected an int, got bool"):
        torch.compile(lambda q: op(q, q, q, window=True), backend="eager")(q)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="window: expected an int, got bool"):
        op.with_kvcache(q[:, :, :1], q, q, cache_seqlens=torch.full((1,), 4, dtype=torch.int32), window=True)


def test_deterministic_mode_with_a_parameter_gradient_is_refused_before_the_forward():
    """deterministic=True (or torch.use_deterministic_algorithms(True)) with a float tensor
    parameter that requires grad (its gradient is summed with fp32 atomics): a RuntimeError, as
    torch raises for an operation without a deterministic implementation, at the forward call
    rather than after it in the backward; with warn_only a warning (in the backward) and the
    gradients. A detached parameter, or no gradient recorded, runs."""
    op = _op("alibi")
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    slopes = torch.rand(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="slopes are summed with fp32 atomics"):
        op(q, q, q, slopes=slopes, deterministic=True)
    op(q, q, q, slopes=slopes.detach(), deterministic=True).sum().backward()
    with torch.no_grad():
        op(q, q, q, slopes=slopes, deterministic=True)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="slopes are summed with fp32 atomics"):
            op(q, q, q, slopes=slopes)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="slopes are summed with fp32 atomics"):
            op(q, q, q, slopes=slopes).sum().backward()
        assert slopes.grad is not None and torch.isfinite(slopes.grad).all()
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.mark.parametrize("var, default", [("FLASHGEN_JIT", True), ("FLASHGEN_QUIET", False),
                                          ("FLASHGEN_AUTO_BLOCK_MASK", True), ("FLASHGEN_AUTOTUNE", False),
                                          ("FLASHGEN_VERBOSE", False), ("FLASHGEN_DEBUG", False)])
def test_boolean_variables_take_the_usual_spellings_and_name_a_bad_value(monkeypatch, var, default):
    """FLASHGEN_JIT=false turned the JIT *on* (only 0 or empty meant off), FLASHGEN_QUIET=false
    made it quiet: now 1/true/yes/on and 0/false/no/off (any case), and anything else is a
    ValueError naming the variable."""
    from flashgen import env

    read = {"FLASHGEN_JIT": env.jit, "FLASHGEN_QUIET": env.quiet, "FLASHGEN_AUTO_BLOCK_MASK": env.auto_block_mask,
            "FLASHGEN_AUTOTUNE": env.autotune, "FLASHGEN_VERBOSE": env.verbose, "FLASHGEN_DEBUG": env.debug}[var]
    monkeypatch.delenv(var, raising=False)
    assert read() is default
    for raw, want in (("1", True), ("true", True), (" Yes ", True), ("ON", True), ("0", False), ("false", False),
                      ("No", False), ("off", False), ("", False), ("2", True), ("00", False)):
        monkeypatch.setenv(var, raw)
        assert read() is want, raw
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=f"{var}='maybe': expected 1 or 0"):
        read()


def test_reference_divides_by_a_zero_scalar_as_ieee_and_the_kernels():
    """A float division by a zero-valued scalar (a parameter of 0, or a constant difference):
    the reference gave a ZeroDivisionError; now ±inf / nan as the kernels compute (IEEE)."""
    op = flashgen.compile("attention negdiv {\n    score = -1 / (1 - 1)\n}\n")
    q = torch.randn(1, 1, 8, 16)
    out, lse = op(q, q, q, return_lse=True)
    ref_out, ref_lse = flashgen.reference.attention(op, q.double(), q.double(), q.double(), return_lse=True)
    assert torch.equal(ref_lse.float(), lse) and (lse == -float("inf")).all()
    assert torch.equal(ref_out.float(), out)
    inv = flashgen.compile("attention invf {\n    param f: float\n    score = score + 1 / f\n}\n")
    ref = flashgen.reference.attention(inv, q.double(), q.double(), q.double(), f=0.0)
    got = inv(q, q, q, f=0.0)
    assert torch.equal(torch.isnan(ref), torch.isnan(got)) and torch.isnan(got).all()


def test_bench_json_path_and_empty_lists_are_checked_before_any_work(capsys, tmp_path):
    """--json that cannot be written fails before the benchmark runs, naming --json; a list
    option given without values is argparse's error (exit 2), not the defaults."""
    base = ["bench", str(SPECS / "causal.attn"), "--seqlen", "32", "--head-dim", "16", "--batch", "1", "--heads", "1",
            "--reps", "1", "--peers", "sdpa"]
    code, _, err = cli(capsys, *base, "--json", str(tmp_path / "missing" / "rows.json"))
    assert code == 2 and "--json:" in err and "does not exist" in err
    code, _, err = cli(capsys, *base, "--json", str(tmp_path))
    assert code == 2 and "--json:" in err and "is a directory" in err
    for option in ("--seqlen", "--head-dim", "--peers"):
        argv = base[:base.index(option) + 1] + base[base.index(option) + 2:] if option != "--peers" else base[:-1]
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert f"argument {option}: expected at least one argument" in capsys.readouterr().err


def test_tiles_names_its_dtype_argument():
    with pytest.raises(ValueError, match=r"^dtype: unknown dtype 'junk'"):
        _op("causal").tiles(None, "junk", 64, arch="sm_90a")


def test_bench_refuses_an_unserved_head_dim_before_timing(capsys):
    code, out, err = cli(capsys, "bench", str(SPECS / "causal.attn"), "--seqlen", "32", "--head-dim", "20",
                         "--batch", "1", "--heads", "1", "--reps", "1", "--peers", "sdpa")
    assert code == 2 and "--head-dim: 20 is not served for spec 'causal' on cpu" in err and "flashgen " not in out


def test_a_bad_verbose_value_is_a_value_error_at_the_first_build(monkeypatch, tmp_path):
    """FLASHGEN_VERBOSE, read by the build, names itself in a ValueError (not a BuildError)."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASHGEN_VERBOSE", "maybe")
    monkeypatch.setenv("FLASHGEN_QUIET", "1")
    op = flashgen.compile("attention verbose_probe {\n    mask = causal\n}\n")
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="FLASHGEN_VERBOSE='maybe'"):
        op(q, q, q)
