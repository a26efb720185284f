"""Spec text → IR: parse with lark (grammar.lark), lower and validate into ``ir.Spec``.

Every error is a ``SpecError`` naming file:line:col with the offending line and a caret.
"""

from __future__ import annotations

import functools
import math
import os
from importlib import resources
from pathlib import Path

import lark
from lark import Lark, Token, Tree

from ..errors import SpecError, did_you_mean
from . import expr as X
from . import ir

STATEMENTS = ("head_dim", "dtype", "scale", "mask", "score", "param", "dropout")
# Statements the grammar reserves for a later version: rejected with "not supported in this
# version", and never offered in an error's list of what was expected.
RESERVED_STATEMENTS = ("block_size",)

# Spellings accepted on `dtype` lines.
DTYPE_NAMES = {
    "fp16": ir.DType.FP16, "float16": ir.DType.FP16, "half": ir.DType.FP16,
    "bf16": ir.DType.BF16, "bfloat16": ir.DType.BF16,
    "fp32": ir.DType.FP32, "float32": ir.DType.FP32, "float": ir.DType.FP32,
}  # fmt: skip

# Spellings accepted for parameter types: scalars (kernel arguments) and tensor element types.
PARAM_TYPES = {
    "int": "int", "float": "float",
    "f32": "f32", "float32": "f32", "i32": "i32", "int32": "i32", "i64": "i64", "int64": "i64",
    "bool": "bool",
}  # fmt: skip
# Names a parameter may not take (functions and call-style built-ins live apart: `window` may
# name a parameter and `window(l, r)` still means the built-in).
RESERVED = set(X.POSITION_NAMES) | set(X.CONSTANTS) | {
    n for n, k in X.MASK_BUILTINS.items() if k == 0} | {"score", "none", "head_dim", "batch", "heads"}
# The op's own keyword arguments, those of flashgen.reference / flashgen.check (which take the
# parameters by keyword too), and the names its schemas and generated code use.
OP_NAMES = {"self", "k", "v", "scale", "return_lse", "deterministic", "dropout_p", "dropout_seed", "dropout_state",
            "dropout_offset", "block_mask", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "out",
            "lse", "dout", "dlse", "need_param_grads", "params", "Params", "spec", "lowp_matmuls", "atol", "grads",
            "param_grads", "wrt", "dropout",
            # op.with_kvcache's keyword arguments (runtime/decode.py) and its schema's
            "k_cache", "v_cache", "cache_seqlens", "block_table", "cache_leftpad", "num_splits", "validate",
            # flashgen.block_mask's (it takes the parameters by keyword too)
            "op", "block_size", "device"}
FLOAT32_MAX = 3.4028234663852886e38  # the largest fp32: the kernels compute in fp32


def _constant(e) -> float | None:
    """The value of ``e`` when it is arithmetic (+ - * / and unary -) on number literals alone,
    computed in float64; None otherwise (or for a division by zero)."""
    if isinstance(e, ir.Num):
        return float(e.value)
    if isinstance(e, ir.Unary) and e.op == "-":
        v = _constant(e.operand)
        return None if v is None else -v
    if isinstance(e, ir.BinOp) and e.op in ("+", "-", "*", "/"):
        a, b = _constant(e.lhs), _constant(e.rhs)
        if a is None or b is None or (e.op == "/" and b == 0):
            return None
        return a + b if e.op == "+" else a - b if e.op == "-" else a * b if e.op == "*" else a / b
    return None


_ORDINAL = ("first", "second")


def _check_builtin_args(e, scope, params: dict) -> None:
    """The mask built-ins' arguments, before they are expanded (whose errors would describe the
    expansion, e.g. "'-' needs numbers", at the call): window's, prefix_lm's, key_padding's and
    chunked's are numbers; document's names a tensor parameter. ExprError at the argument."""
    for n in X.walk(e):
        if not (isinstance(n, ir.Call) and n.fn in X.MASK_BUILTINS) or len(n.args) != X.MASK_BUILTINS[n.fn]:
            continue
        if n.fn == "document":
            arg = n.args[0]
            p = params.get(arg.id) if isinstance(arg, ir.Name) else None
            if p is None or not p.is_tensor:
                raise X.ExprError(arg, "document()'s argument must name a tensor parameter of sequence ids",
                                  expected="e.g. `param document_id: i32[batch, seqlen_k]` and document(document_id)")
            continue
        for i, arg in enumerate(n.args):
            t = X.type_of(arg, scope)
            if t == X.BOOL:
                raise X.ExprError(arg, f"{n.fn}()'s {_ORDINAL[i]} argument must be a number, got a comparison or "
                                       "boolean")


CXX_KEYWORDS = set("""alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
char32_t class compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
decltype default delete do double dynamic_cast else enum explicit export extern false float for friend goto if
inline int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected public
register reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch
template this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile
wchar_t while xor xor_eq int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t size_t""".split())

# Lower-case names the C/C++ and CUDA headers define as macros (upper-case names are refused as a
# class: NAN, EOF, INT_MAX, ... would be replaced by the preprocessor in the generated code).
C_MACROS = {"errno", "assert", "stdin", "stdout", "stderr", "offsetof", "math_errhandling", "setjmp", "va_arg",
            "va_start", "va_end", "va_copy", "alloca"}

HEAD_DIM_MAX = 256
MAX_NAME = 64
# How deeply an expression may nest (a sum of n terms nests n deep): every stage walks
# expressions recursively, and this keeps them far from Python's recursion limit.
MAX_DEPTH = 100

_TERMINAL_TEXT = {
    "_NL": "end of line", "NAME": "a name", "INT": "an integer", "NUMBER": "a number",
    "COMP_OP": "a comparison operator", "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/', '//' or '%'",
    "$END": "end of file",
}  # fmt: skip


@functools.cache
def _parser() -> Lark:
    text = resources.files(__package__).joinpath("grammar.lark").read_text()
    # cache=True keeps the LALR tables in a temp file keyed by the grammar: faster startup.
    return Lark(text, parser="lalr", propagate_positions=True, maybe_placeholders=True, cache=True)


def parse(source: str | Path, *, text: str | None = None) -> ir.Spec:
    """Parse and validate a spec.

    Args:
        source: a path to a ``.attn`` file, or spec text (anything containing a newline or '{',
            or a string that names no file and looks like no path: no '/', no ``.attn`` ending).
        text: spec text; when given, ``source`` is only the file name used in messages.

    Returns:
        The validated ``ir.Spec``.

    Raises:
        SpecError: with file:line:col, the line and a caret, what was expected, "did you mean".
        FileNotFoundError: ``source`` looks like a path (a ``.attn`` name or a '/' in it) and
            names no file.
    """
    guessed = False  # a string that names no file and does not look like a path: parsed as text
    if text is None:
        if isinstance(source, Path) or ("\n" not in source and "{" not in source):
            path = Path(source)
            if path.is_dir():
                raise IsADirectoryError(f"spec: {path} is a directory (expected a .attn file or spec text)")
            if isinstance(source, str) and not _path_like(source) and not path.exists():
                text, file, guessed = source, "<spec>", True
            else:
                try:
                    text, file = path.read_text(encoding="utf-8"), str(path)
                except FileNotFoundError:
                    raise FileNotFoundError(f"spec: {path}: no such file (expected a .attn file or spec "
                                            "text)") from None
                except UnicodeDecodeError as e:
                    raise ValueError(f"spec: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        else:
            text, file = source, "<spec>"
    else:
        file = str(source)
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not part of the spec
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        err = _syntax_error(e, text, file)
        if guessed:
            err = SpecError(err.summary, file=file, source=text, line=err.line, column=err.column,
                            expected=err.expected, hint=f"no file named {source!r} exists, so it was read as spec "
                                                        "text (a spec starts with `attention NAME {`)")
        raise err from None
    _check_depth(tree, text, file)
    try:
        return _Lowering(file, text).spec(tree)
    except RecursionError:
        raise SpecError("the spec nests too deeply to check", file=file, source=text, line=1, column=1,
                        expected=f"expressions at most {MAX_DEPTH} levels deep") from None


def _check_depth(tree: Tree, text: str, file: str) -> None:
    """SpecError at the expression of the first statement that nests deeper than MAX_DEPTH (the
    tree is walked without recursion, however deep it is)."""
    for stmt in tree.children[0].children[1:]:
        if not isinstance(stmt, Tree):
            continue
        deepest, stack = 0, [(stmt, 0)]
        while stack:
            node, depth = stack.pop()
            deepest = max(deepest, depth)
            stack.extend((c, depth + 1) for c in node.children if isinstance(c, Tree))
        if deepest > MAX_DEPTH + 1:  # the statement itself is one level
            at = next((c for c in stmt.children if isinstance(c, Tree)), stmt)
            raise SpecError(f"expression nests {deepest - 1} levels deep", file=file, source=text,
                            line=at.meta.line, column=at.meta.column,
                            expected=f"at most {MAX_DEPTH} levels (a sum of n terms nests n deep)")


def _path_like(source: str) -> bool:
    """Whether a string that names no file was meant as a path (a .attn name, or a folder in it)."""
    return source.endswith(".attn") or "/" in source or os.sep in source


# ---------------------------------------------------------------- syntax errors


def _describe(terminals) -> str:
    parser = _parser()
    names = []
    for t in sorted(terminals):
        if t in _TERMINAL_TEXT:
            names.append(_TERMINAL_TEXT[t])
            continue
        try:
            pattern = parser.get_terminal(t).pattern
        except KeyError:
            names.append(t)
            continue
        if pattern.type == "str" and pattern.value in RESERVED_STATEMENTS:
            continue
        names.append(f"'{pattern.value}'" if pattern.type == "str" else t.lower())
    names = sorted(set(names))
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def _word_at(text: str, pos: int) -> str:
    end = pos
    while end < len(text) and (text[end].isalnum() or text[end] == "_"):
        end += 1
    return text[pos:end]


def _syntax_error(e: lark.exceptions.UnexpectedInput, text: str, file: str) -> SpecError:
    line, column = getattr(e, "line", -1), getattr(e, "column", -1)
    at_eof = isinstance(e, lark.exceptions.UnexpectedToken) and e.token.type == "$END"
    if isinstance(e, lark.exceptions.UnexpectedEOF) or line < 0 or at_eof:
        lines = text.splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
        return SpecError("unexpected end of file", file=file, source=text, line=line, column=column,
                         expected=_describe(e.expected))
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        expected = set(e.allowed or ())
        found = _word_at(text, e.pos_in_stream)
        if not found:
            return SpecError(f"unexpected character {text[e.pos_in_stream]!r}", file=file, source=text,
                             line=line, column=column)
    else:
        expected = set(e.expected or ())
        tok = e.token
        found = "end of line" if tok.type == "_NL" else str(tok)
    keywords = {t for t in expected if t.upper() in {s.upper() for s in STATEMENTS + RESERVED_STATEMENTS}}
    hint = None
    if keywords and found.isidentifier():
        hint = did_you_mean(found, STATEMENTS)
        return SpecError(f"unknown statement '{found}'", file=file, source=text, line=line,
                         column=column, expected="a statement: " + ", ".join(STATEMENTS), hint=hint)
    if isinstance(e, lark.exceptions.UnexpectedToken) and e.token.type == "COMP_OP":
        hint = "comparisons do not chain: write `a <= b and b <= c` for `a <= b <= c`"
    return SpecError(f"unexpected {found!r}" if found != "end of line" else "unexpected end of line",
                     file=file, source=text, line=line, column=column, expected=_describe(expected),
                     hint=hint)


# ---------------------------------------------------------------- lowering


class _Lowering:
    def __init__(self, file: str, text: str):
        self.file, self.text = file, text

    def span(self, node) -> ir.Span:
        meta = node.meta if isinstance(node, Tree) else node
        return ir.Span(self.file, meta.line, meta.column)

    def error(self, node, message: str, **kw) -> SpecError:
        s = self.span(node)
        return SpecError(message, file=self.file, source=self.text, line=s.line, column=s.column, **kw)

    # expressions -------------------------------------------------------

    def expr(self, node) -> ir.Expr:
        if isinstance(node, Token):  # bare NAME/NUMBER tokens never reach here; trees do
            raise AssertionError(node)
        span, kind, ch = self.span(node), node.data, node.children
        if kind == "name":
            return ir.Name(str(ch[0]), span)
        if kind == "number":
            text = str(ch[0])
            if "." not in text and "e" not in text.lower():
                if int(text) >= 2**63:
                    raise self.error(node, f"integer {text} does not fit in 64 bits")
                return ir.Num(int(text), span)
            v = float(text)
            if not v <= FLOAT32_MAX:
                raise self.error(node, f"number {text} is beyond fp32's range (the kernels compute in fp32)")
            return ir.Num(v, span)
        if kind == "neg":
            return ir.Unary("-", self.expr(ch[0]), span)
        if kind == "not_op":
            return ir.Unary("not", self.expr(ch[0]), span)
        if kind in ("binop", "compare"):
            return ir.BinOp(str(ch[1]), self.expr(ch[0]), self.expr(ch[2]), span)
        if kind in ("and_op", "or_op"):
            return ir.BinOp(kind[:-3], self.expr(ch[0]), self.expr(ch[1]), span)
        if kind == "call":
            args = tuple(self.expr(a) for a in ch[1:] if a is not None)
            return ir.Call(str(ch[0]), args, span)
        if kind == "index":
            return ir.Index(self.expr(ch[0]), tuple(self.expr(a) for a in ch[1:]), span)
        raise AssertionError(kind)

    # statements --------------------------------------------------------

    def spec(self, tree: Tree) -> ir.Spec:
        spec = tree.children[0]
        name_tok, *stmts = spec.children
        seen: dict[str, Tree] = {}
        fields: dict = {}
        self.declared = {str(st.children[0]) for st in stmts if st is not None and st.data == "param_stmt"}
        for st in stmts:
            if st is None:
                continue
            key = st.data.removesuffix("_stmt")
            if key in seen and key != "param":
                raise self.error(st, f"duplicate '{key}' statement (first on line {seen[key].meta.line})")
            seen[key] = st
            getattr(self, "stmt_" + key)(st, fields)
        if len(str(name_tok)) > MAX_NAME:
            raise self.error(name_tok, f"spec name is {len(str(name_tok))} characters long",
                             expected=f"at most {MAX_NAME} (it names files and symbols)")
        return ir.Spec(name=str(name_tok), span=ir.Span(self.file, name_tok.line, name_tok.column), **fields)

    def stmt_head_dim(self, st: Tree, fields: dict) -> None:
        dims = []
        for tok in st.children:
            d = int(tok)
            if d % 8 or not 8 <= d <= HEAD_DIM_MAX:
                raise self.error(tok, f"head_dim {d} is not supported",
                                 expected=f"a multiple of 8 from 8 to {HEAD_DIM_MAX}")
            if d in dims:
                raise self.error(tok, f"head_dim {d} is listed twice")
            dims.append(d)
        fields["head_dims"] = tuple(sorted(dims))

    def stmt_dtype(self, st: Tree, fields: dict) -> None:
        out: dict[ir.DType, str] = {}  # dtype -> the spelling that listed it first
        for tok in st.children:
            dt = DTYPE_NAMES.get(str(tok))
            if dt is None:
                raise self.error(tok, f"unknown dtype '{tok}'", expected="one of fp16, bf16, fp32",
                                 hint=did_you_mean(str(tok), DTYPE_NAMES))
            if dt in out:  # also under another spelling (bf16, bfloat16)
                first = out[dt]
                raise self.error(tok, f"dtype {tok} is listed twice" + (f" (as '{first}')" if first != tok else ""))
            out[dt] = str(tok)
        fields["dtypes"] = tuple(sorted(out, key=lambda d: d.value))

    def stmt_scale(self, st: Tree, fields: dict) -> None:
        expr = self.expr(st.children[0])
        # Validate now (names, functions, positivity) with a representative head dim.
        value = evaluate_scale(expr, 64, self)
        if not (math.isfinite(value) and value > 0):
            raise self.error(st.children[0], f"scale must be a positive finite number, got {value}")
        if value > FLOAT32_MAX:  # the kernels take it as an fp32
            raise self.error(st.children[0], f"scale is {value:g} at head_dim 64, beyond fp32's range (3.4e38)")
        fields["scale"] = expr

    def _checked(self, node, e: ir.Expr, fields: dict, *, allow_score: bool) -> tuple[ir.Expr, str]:
        params = {p.name: p for p in fields.get("params", ())}
        try:
            positive = X.positive_params(e, X.Scope(params, allow_score=allow_score))
            _check_builtin_args(e, X.Scope(params, allow_score=allow_score), params)
            e = X.expand_builtins(e)
            t = X.type_of(e, X.Scope(params, allow_score=allow_score))
            for n in X.walk(e):
                if isinstance(n, ir.BinOp) and n.op in ("/", "//", "%") and n.rhs == ir.Num(0):
                    raise X.ExprError(n, f"division by zero ('{n.op} 0')")
                value = _constant(n) if isinstance(n, ir.BinOp) else None
                if value is not None and math.isfinite(value) and abs(value) > FLOAT32_MAX:
                    raise X.ExprError(n, f"this constant is {value:g}, beyond fp32's range (the kernels compute "
                                         "in fp32, where it is inf)")
            if positive:
                fields["positive"] = tuple(dict.fromkeys(fields.get("positive", ()) + positive))
            return e, t
        except X.ExprError as err:
            raise self.error_at(err.node, node, err.message, expected=err.expected, hint=err.hint) from None

    def error_at(self, e, fallback, message: str, **kw) -> SpecError:
        span = getattr(e, "span", None)
        if span is None:
            return self.error(fallback, message, **kw)
        return SpecError(message, file=self.file, source=self.text, line=span.line, column=span.column, **kw)

    def stmt_mask(self, st: Tree, fields: dict) -> None:
        node = st.children[0]
        e = self.expr(node)
        if e == ir.Name("none"):
            fields["mask_span"] = e.span
            return
        if isinstance(e, ir.Name) and e.id not in X.MASK_BUILTINS and e.id not in X.CONSTANTS and \
                e.id not in X.POSITION_NAMES and not any(p.name == e.id for p in fields.get("params", ())):
            names = ["none", *[n for n, k in X.MASK_BUILTINS.items() if k == 0]]
            raise self.error(node, f"unknown mask '{e.id}'",
                             expected="a mask expression or one of " + ", ".join(names),
                             hint=did_you_mean(e.id, names + list(X.MASK_BUILTINS)))
        e, t = self._checked(node, e, fields, allow_score=False)
        if t != X.BOOL:
            raise self.error(node, f"mask must be a condition (true keeps the score), got {'an' if t == 'int' else 'a'} "
                             f"{t} expression",
                             expected="a comparison such as 'kv <= q' combined with and/or/not")
        fields["mask"] = e
        fields["mask_span"] = self.span(node)

    def stmt_score(self, st: Tree, fields: dict) -> None:
        node = st.children[0]
        e, t = self._checked(node, self.expr(node), fields, allow_score=True)
        if t == X.BOOL:
            raise self.error(node, "score must be a number, got a condition",
                             expected="an expression of score, e.g. 'score + bias[b, h, q, kv]'")
        if e == ir.Name("score"):
            return  # the identity
        fields["score"] = e
        fields["score_span"] = self.span(node)

    def stmt_param(self, st: Tree, fields: dict) -> None:
        name_tok, type_tok, *rest = st.children
        shape = rest[0] if rest else None
        name, tname = str(name_tok), str(type_tok)
        params = list(fields.get("params", ()))
        import keyword

        if name in RESERVED:
            raise self.error(name_tok, f"'{name}' is a reserved name and cannot name a parameter")
        if name in OP_NAMES or keyword.iskeyword(name) or name in CXX_KEYWORDS or name.startswith(("fg_", "__")):
            raise self.error(name_tok, f"'{name}' cannot name a parameter (it is a keyword or a name the op "
                             "and its generated code use)", expected="another name")
        if name in C_MACROS or (name.upper() == name and sum(c.isalpha() for c in name) >= 2):
            raise self.error(name_tok, f"'{name}' cannot name a parameter (it is, or looks like, a C/C++ macro, "
                             "which the generated code would not survive)", expected="a lower-case name",
                             hint=f"try '{name.lower()}'" if name.lower() not in C_MACROS else None)
        for other in params:
            for suffix in ("_size", "_stride", "_grad"):
                if name == other.name + suffix or other.name == name + suffix:
                    raise self.error(name_tok, f"'{name}' clashes with the generated member '{other.name}{suffix}' "
                                     f"of parameter '{other.name}'"
                                     if name == other.name + suffix else
                                     f"'{name}' would generate a member '{name}{suffix}' that clashes with "
                                     f"parameter '{other.name}'", expected="another name")
        if len(name) > MAX_NAME:
            raise self.error(name_tok, f"parameter name is {len(name)} characters long", expected=f"at most {MAX_NAME}")
        if any(p.name == name for p in params):
            raise self.error(name_tok, f"parameter '{name}' is declared twice")
        if "mask" in fields or "score" in fields:
            raise self.error(st, f"parameter '{name}' is declared after the expressions that could use it",
                             expected="'param' lines before 'mask' and 'score'")
        kind = PARAM_TYPES.get(tname)
        if kind is None:
            raise self.error(type_tok, f"unknown parameter type '{tname}'",
                             expected="int, float (scalars) or f32, i32, i64, bool with a shape",
                             hint=did_you_mean(tname, PARAM_TYPES))
        span = self.span(name_tok)
        if kind in ir.SCALAR_KINDS:
            if shape is not None:
                raise self.error(shape, f"scalar parameter '{name}' ({kind}) takes no shape",
                                 expected=f"'param {name}: f32[...]' for a tensor")
            params.append(ir.Param(name, kind, span=span))
        else:
            if shape is None or not shape.children or shape.children == [None]:
                raise self.error(type_tok, f"tensor parameter '{name}' needs a shape",
                                 expected=f"e.g. 'param {name}: {tname}[batch, heads]'")
            dims = tuple(self.dim(d, params) for d in shape.children)
            params.append(ir.Param(name, "tensor", kind, dims, span=span))
        fields["params"] = tuple(params)

    def dim(self, node: Tree, params: list[ir.Param]) -> ir.Dim:
        size_node, *rest = node.children
        alt = rest[0] if rest else None
        size = self.expr(size_node)
        ints = {p.name for p in params if p.kind == "int"}
        allowed = set(X.SHAPE_DIMS) | ints
        floats = {p.name for p in params if p.kind == "float"}
        for n in X.walk(size):
            if isinstance(n, ir.Name) and n.id in floats:
                raise self.error_at(n, size_node, f"dimension uses float parameter '{n.id}'",
                                    expected="batch, heads, seqlen_q, seqlen_k, integers or int parameters")
            if isinstance(n, ir.Name) and n.id not in allowed and n.id in getattr(self, "declared", ()):
                raise self.error_at(n, size_node, f"dimension uses parameter '{n.id}' before its declaration",
                                    expected=f"'param {n.id}: int' on an earlier line")
            if isinstance(n, ir.Name) and n.id not in allowed:
                raise self.error_at(n, size_node, f"unknown dimension '{n.id}'",
                                    expected="batch, heads, seqlen_q, seqlen_k, integers or int parameters",
                                    hint=did_you_mean(n.id, sorted(allowed)))
            if isinstance(n, ir.Num) and not isinstance(n.value, int):
                raise self.error_at(n, size_node, "dimensions are integers")
            if not isinstance(n, ir.Num | ir.Name | ir.BinOp | ir.Unary) or (
                    isinstance(n, ir.BinOp) and n.op not in ("+", "-", "*", "//")):
                raise self.error_at(n, size_node, "unsupported operation in a dimension",
                                    expected="+, -, * and // of integers")
        if (isinstance(size, ir.Num) and size.value < 1) or (
                isinstance(size, ir.Unary) and isinstance(size.operand, ir.Num)):
            raise self.error(size_node, "dimension is not positive")
        broadcast = False
        if alt is not None:
            a = self.expr(alt)
            if a != ir.Num(1):
                raise self.error(alt, "only '|1' is allowed after a dimension (it may also be 1: broadcast)")
            broadcast = True
        return ir.Dim(size, broadcast, self.span(size_node))

    def stmt_dropout(self, st: Tree, fields: dict) -> None:
        # A bare declaration: the op then takes dropout_p at call time (a repeat is caught above).
        fields["dropout"] = True

    def _not_yet(self, st: Tree, fields: dict) -> None:
        raise self.error(st, f"'{st.data.removesuffix('_stmt')}' is not supported in this version")

    stmt_block_size = _not_yet


_SCALE_FUNCS = {"sqrt": math.sqrt, "exp": math.exp, "log": math.log, "abs": abs}


def evaluate_scale(expr: ir.Expr, head_dim: int, lowering: _Lowering | None = None) -> float:
    """Evaluate a ``scale = ...`` expression (numbers, head_dim, + - * /, sqrt/exp/log/abs)."""

    def fail(node, msg, **kw):
        if lowering is None:
            raise ValueError(msg)
        raise SpecError(msg, file=lowering.file, source=lowering.text, line=node.span.line,
                        column=node.span.column, **kw)

    def ev(n):
        if isinstance(n, ir.Num):
            return float(n.value)
        if isinstance(n, ir.Name):
            if n.id == "head_dim":
                return float(head_dim)
            fail(n, f"unknown name '{n.id}' in scale", expected="numbers and head_dim",
                 hint=did_you_mean(n.id, ["head_dim"]))
        if isinstance(n, ir.Unary) and n.op == "-":
            return -ev(n.operand)
        if isinstance(n, ir.BinOp) and n.op in "+-*/":
            a, b = ev(n.lhs), ev(n.rhs)
            if n.op == "/" and b == 0:
                fail(n, "division by zero in scale")
            return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[n.op]
        if isinstance(n, ir.Call) and n.fn in _SCALE_FUNCS:
            if len(n.args) != 1:
                fail(n, f"{n.fn}() takes 1 argument, got {len(n.args)}")
            arg = ev(n.args[0])
            try:
                return float(_SCALE_FUNCS[n.fn](arg))
            except (ValueError, OverflowError):
                fail(n, f"{n.fn}() of an invalid value in scale")
        if isinstance(n, ir.Call):
            fail(n, f"unknown function '{n.fn}' in scale", expected="one of " + ", ".join(_SCALE_FUNCS),
                 hint=did_you_mean(n.fn, _SCALE_FUNCS))
        fail(n, "unsupported operation in scale", expected="numbers, head_dim, + - * / and sqrt()")

    return ev(expr)
