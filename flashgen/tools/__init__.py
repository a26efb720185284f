"""Tools above the runtime: ahead-of-time builds, golden renders, the spec fuzzer (the command line
is flashgen/cli.py)."""
