"""The spec language: grammar and parser (frontend, grammar.lark), the IR (ir), what the stages
share about expressions (expr: types, built-ins, C++ emission, derivatives) and closed-form key
ranges (keyrange)."""
