"""What a new user meets first: spec checks (literal indices out of range, expressions nested too
deeply, text that is not a spec), the command line's messages and help, autocast, a block mask
under torch.compile without warnings, and the package's declared dependencies."""

import importlib.metadata
import re

import pytest

import flashgen
from flashgen.errors import SpecError
from flashgen.lang import frontend

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


# ------------------------------------------------------------------ packaging


def test_numpy_is_a_declared_dependency():
    """torch warns "Failed to initialize NumPy" at import without numpy, on every command."""
    requires = importlib.metadata.requires("flashgen") or []
    assert any(re.match(r"numpy\b", r) for r in requires), requires
