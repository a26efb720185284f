"""Integrations with other libraries: ``flashgen.integrations.transformers`` (Hugging Face)."""
