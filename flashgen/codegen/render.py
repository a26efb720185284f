"""The render step: a spec's variant and a family's templates → one C++ translation unit each.

The kernel skeletons are hand-written headers (templates/include/flashgen/{cpu,cuda}); a spec
only becomes a small ``Variant`` struct (templates/variant.h.jinja, its content from
flashgen/codegen/variant.py) spliced into one translation unit per instantiation
(templates/cpu_fwd.cpp.jinja, templates/cuda_fwd.cu.jinja), rendered strictly.
"""

from __future__ import annotations

import functools

from ..lang import ir
from ..paths import templates_dir
from .variant import variant_context

# Element type spelled per family (tables, not if-chains).
CPU_ELEMENT = {ir.DType.FP32: "float", ir.DType.BF16: "c10::BFloat16", ir.DType.FP16: "c10::Half"}
CUDA_ELEMENT = {ir.DType.BF16: "__nv_bfloat16", ir.DType.FP16: "__half"}


@functools.cache
def environment():
    """The one Jinja2 environment: strict undefined names, block whitespace trimmed."""
    import jinja2  # imported on first render only: a cached load never renders

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **context) -> str:
    """Render one template strictly; an undefined name raises, naming template and line."""
    import jinja2  # lazily, as in environment()

    try:
        return environment().get_template(template).render(**context)
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'filename', None) or template}:{getattr(e, 'lineno', '?')}"
        raise RuntimeError(f"template error in {where}: {e}") from e


# Translation-unit templates of families whose kernels are not their device type's default
# (cpu_<kind>.cpp.jinja, cuda_<kind>.cu.jinja): (family, kind) -> template.
FAMILY_TEMPLATES = {("sm90", "fwd"): "sm90_fwd.cu.jinja", ("sm90", "bwd"): "sm90_bwd.cu.jinja"}


def render_instantiation(spec: ir.Spec, backend: str, kind: str, dtype: ir.DType, head_dim: int | None,
                         symbol: str, config: dict, family: str | None = None) -> str:
    """One translation unit ('fwd' or 'bwd') of an instantiation of ``family``'s kernels:
    header comment, variant struct, entry points."""
    ctx = variant_context(spec) | {
        "symbol": symbol,
        "kind": kind,
        "dtype": dtype.value,
        "head_dim": head_dim,
        "config": config,
    }
    if backend == "cpu":
        return render(f"cpu_{kind}.cpp.jinja", element=CPU_ELEMENT[dtype], **ctx)
    template = FAMILY_TEMPLATES.get((family, kind), f"cuda_{kind}.cu.jinja")
    return render(template, element=CUDA_ELEMENT[dtype], **ctx)
