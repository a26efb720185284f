"""Loading an instantiation's library: the loader sits above the build cache
(flashgen/build/cache.py) and the ahead-of-time directories (flashgen/build/aot.py), which know nothing of
each other.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import env
from ..build import aot, artifact, cache
from ..errors import NotBuiltError


def load(inst: artifact.Instantiation, *, announce: Callable[[str], None] | None = None) -> cache.LoadedLibrary:
    """The loaded library for ``inst``: from an ahead-of-time directory (FLASHGEN_AOT_DIR,
    flashgen.build.aot), this process, the cache, or a fresh build.

    ``announce`` is called with a message before a compile starts (a cache miss). With JIT
    disabled (FLASHGEN_JIT=0) only the ahead-of-time directories are searched: nothing is
    rendered or compiled and the cache is not touched.

    Raises:
        BuildError: the compiler failed.
        NotBuiltError (a BuildError): JIT is disabled and no ahead-of-time
            directory holds ``inst``; the message names the variant and the command that
            builds it.
    """
    dirs = env.aot_dirs()
    if dirs or not env.jit():
        lib, notes = aot.find(inst, dirs) if dirs else (None, [])
        if lib is not None:
            return lib
        if not env.jit():
            raise NotBuiltError(aot.not_built_message(inst, dirs, notes))
    return cache.load_cached(inst, announce)
