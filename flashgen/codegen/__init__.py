"""Code generation: a spec's C++ variant (variant: Params fields, hook bodies) rendered into a
family's Jinja2 templates (render)."""
