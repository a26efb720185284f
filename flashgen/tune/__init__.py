"""Tuned tile configurations, one stage per module:

- ``store``: the per-GPU store of winners (read, merged with the ahead-of-time directories'
  tuning/ files, looked up by the tile choice, recorded by the tuner). A low module: it imports
  no op, build or tile code; the tile rules register which configs are well formed with it, and
  the op runtime registers a callback that drops its cached library choices on a reload.
- ``resources``: the compiler's resource report (cuobjdump -res-usage: registers, spills).
- ``timing``: the timed inputs, CUDA-event medians and the output check of a candidate.
- ``tuner``: ``tune_op`` / ``tune_many`` (``flashgen tune``) and the first-use tuner
  ``ensure_tuned`` (FLASHGEN_AUTOTUNE=1), which it plugs into the op runtime when imported
  (``import flashgen`` does). The candidates are the kernel family's of each pass
  (flashgen/families/sm80_tuning.py, sm90_tuning.py: on Hopper the sm90 forward and the sm80
  backward).

Nothing is re-exported here: importing ``flashgen.tune.store`` runs this file first, and it must
not pull in the tuner (which imports the op runtime, which imports the store).
"""
