// flashgen CPU tile layer: the (query tile, kv tile) sizes of both passes. They are chosen per
// call on the host -- flashgen/families/cpu_tiles.py, the one implementation of the rule (from
// the per-core L2, the thread count and the variant's key ranges; block lists: their block
// sizes; the FLASHGEN_CPU_TILES / FLASHGEN_CPU_BWD_TILES overrides) -- and passed in the
// argument blocks (args.h: tile_q, tile_kv); here they are read and checked.
#pragma once

#include <stdint.h>

#include "flashgen/args.h"

namespace flashgen {
namespace cpu {
namespace detail {

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Tile sizes of the forward: qb query rows x kvb keys.
struct Tiles {
  int64_t qb, kvb;
};

// The forward's tiles from args (tile_q, tile_kv): false, for FG_ERR_BAD_SHAPE, unless
// 1 <= tile_q <= 1024 and tile_kv is a multiple of 8 in [8, 8192] (the range the host's rule and
// its override produce; 0, "not set", is refused), and, with block lists (kv_blocks.data set),
// tile_q == kv_blocks.block_r and tile_kv a multiple of kv_blocks.block_c.
static inline bool fwd_tiles_of(const FgFwdArgs& a, Tiles& t) {
  const int64_t qb = a.tile_q, kvb = a.tile_kv;
  if (qb < 1 || qb > 1024 || kvb < 8 || kvb > 8192 || kvb % 8 != 0) return false;
  if (a.kv_blocks.data && (qb != a.kv_blocks.block_r || kvb % a.kv_blocks.block_c != 0)) return false;
  t = {qb, kvb};
  return true;
}

// Tile sizes of the backward: qb query rows per step over a kv tile of kvb keys.
struct BwdTiles {
  int64_t qb, kvb;
};

// The backward's tiles from args (tile_q, tile_kv): false, for FG_ERR_BAD_SHAPE, unless
// 1 <= tile_q <= 1024 and tile_kv is a multiple of 8 in [8, 1024], and, with block lists
// (q_blocks.data set), tile_q == q_blocks.block_c and tile_kv == q_blocks.block_r.
static inline bool bwd_tiles_of(const FgBwdArgs& a, BwdTiles& t) {
  const int64_t qb = a.tile_q, kvb = a.tile_kv;
  if (qb < 1 || qb > 1024 || kvb < 8 || kvb > 1024 || kvb % 8 != 0) return false;
  if (a.q_blocks.data && (qb != a.q_blocks.block_c || kvb != a.q_blocks.block_r)) return false;
  t = {qb, kvb};
  return true;
}

// The score-mod path of the backward (raw scores kept in a G tile, hooks per element): taken with
// a score mod, and also for a parameter gradient without one (score() is then the identity).
template <class Variant>
constexpr bool bwd_mod_path() {
  return Variant::kHasScoreMod || Variant::kHasParamGrad;
}

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen
