// Plain (torch-free) parameters of the greedy placement of Magi's dynamic solver
// (dcp.baselines.magi_dynamic.solve, its inner `place`): tiles placed on the least-loaded rank their q and kv
// blocks may both reach, then refined off ranks above the cap. The Python loop defines the semantics; this
// is the same loop, operation for operation (the same float sums in the same order, ties to the lowest rank),
// so both give identical placements. Up to 64 ranks (one 64-bit mask per tile).
#pragma once

#include <cstdint>

namespace dcp {

struct MagiPlaceParams {
  int64_t n_tiles = 0, n_ranks = 0, n_free = 0, n_movable = 0, refine_passes = 0;
  const uint64_t* mask = nullptr;          // [n_tiles] ranks holding (or receiving) both of a tile's blocks
  const int64_t* degree = nullptr;         // [n_tiles] popcount of mask
  const int64_t* home = nullptr;           // [n_tiles] its q block's home rank
  const double* area = nullptr;            // [n_tiles]
  const int64_t* free_order = nullptr;     // [n_free] tiles to place, in placement order
  const int64_t* movable_order = nullptr;  // [n_movable] tiles the refinement may move, in its order
  double avg = 0.0, cap = 0.0;             // mean area per rank; the per-rank cap
  int64_t* rank = nullptr;                 // [n_tiles] in: fixed tiles' ranks (others -1); out: every tile's
  double* load = nullptr;                  // [n_ranks] in: the fixed tiles' area per rank; out: final loads
};

// Places p.free_order's tiles and refines; returns whether every rank ends within p.cap.
bool magi_place(const MagiPlaceParams& p);

}  // namespace dcp
