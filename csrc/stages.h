// Plain (torch-free) parameters of the planner's tile staging (dcp.schedule.stages.tile_stages): each staged
// device's tiles paced into stages, local work first, partial outputs that leave the device early. The Python
// reference dcp.schedule.stages.tile_stages_reference defines the semantics; this is the same loop, operation
// for operation (the same sums in the same order), so both give identical stages.
#pragma once

#include <cstdint>

namespace dcp {

struct StagesParams {
  int64_t n_tiles = 0, n_dev = 0, n_stages = 1;
  const int64_t* tile_device = nullptr;  // [n_tiles]
  const int64_t* release = nullptr;      // [n_tiles] round its last input arrives (0: local)
  const int64_t* out_unit = nullptr;     // [n_tiles] remote partial output unit (-1: none)
  const double* tile_time = nullptr;     // [n_tiles] seconds
  const uint8_t* staged = nullptr;       // [n_dev] device computes in paced stages
  const double* round_s = nullptr;       // [n_dev, round_width] or null: how long each round's transfers take
  int64_t round_width = 0;
  int64_t* stage = nullptr;              // [n_tiles] out
};

void tile_stages(const StagesParams& p);

}  // namespace dcp
