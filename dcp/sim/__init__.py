"""Discrete-event simulation of plans: modelled (not measured) forward/backward timelines.

``simulate(plan, cost, direction) -> SimResult``; ``simulate_both(plan, cost) -> (fwd, bwd)``;
``iteration_time_s(fwd, bwd)``; ``to_chrome_trace(results, path)`` for chrome://tracing / Perfetto.
The fluid max-min fair network model is ``dcp.sim.network.FluidNetwork`` (``dcp.sim.flows.ComponentNetwork``
recomputes it per component, for scale); ``dcp.sim.reference.simulate_reference`` is the simulator's
test oracle. Pure numpy, except that the event loop runs in C++ (``dcp._C.simulate_streams``, fed
torch tensors) when the extension is built and no events are recorded (``simulate(..., native=False)``:
the Python loop).
"""
from dcp.sim.events import SimEvent, SimResult, iteration_time_s
from dcp.sim.network import FluidNetwork, max_min_rates
from dcp.sim.simulator import ideal_time_s, simulate, simulate_both, tile_times
from dcp.sim.trace import to_chrome_trace, trace_events

__all__ = ["FluidNetwork", "max_min_rates", "SimEvent", "SimResult", "simulate", "simulate_both",
           "iteration_time_s", "ideal_time_s", "tile_times", "to_chrome_trace", "trace_events"]
