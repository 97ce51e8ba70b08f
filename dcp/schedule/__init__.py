"""Stage 3, placement → programs: order each device's tiles into stages, route the inputs and partial
outputs in rounds, and build the columnar programs of a validated ``Plan``.

- ``stages``: ``schedule(...) -> Schedule`` (tile stages and ``Routes``), the stage and route rules;
- ``rounds``: which round each remote input travels in (transfers of stage s+1 overlap compute of stage s);
- ``build``: ``build_program(direction, tile_stage, routes) -> Program``;
- ``assemble``: the ``Planner`` interface, ``StaticParts`` and ``assemble`` (programs + validation).
The static baselines (``dcp.baselines``) and dcp's planner (``dcp.planner``) both stand on this stage.
"""
from dcp.schedule.assemble import Planner, StaticParts, assemble, assemble_static
from dcp.schedule.build import build_program
from dcp.schedule.stages import Demands, Routes, Schedule, schedule

__all__ = ["Planner", "StaticParts", "assemble", "assemble_static", "build_program", "Demands", "Routes", "Schedule",
           "schedule"]
