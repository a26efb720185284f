"""The build stage: what an artifact is and its cache key (artifact), compiling and the cache
(cache), ahead-of-time directories (aot)."""
