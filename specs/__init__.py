"""The example specs, shipped as package data (flashgen.paths.specs_dir finds them)."""
