"""Stage 1, what a batch is made of: ``BatchSpec`` → token blocks, head blocks and tiles.

- ``blocks``: ``BlockLayout`` (token blocks × head blocks, each token block one sequence's run of tokens),
  ``TileSet`` (the non-empty (q block, kv block, head block) tiles with their exact pair counts and FLOPs);
- ``tiles``: ``enumerate_tiles(spec, layout) -> TileSet``;
- ``pieces``: grouped layouts, where short sequences share a block as pieces;
- ``units``: the data units that move between devices (Q, KV, O/LSE and their backward kinds), in bytes.
"""
from dcp.layout.blocks import BlockLayout, TileSet, make_layout, uniform_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.layout.units import Kind, bytes_per_token, unit_bytes

__all__ = ["BlockLayout", "TileSet", "make_layout", "uniform_layout", "enumerate_tiles", "Kind", "bytes_per_token",
           "unit_bytes"]
