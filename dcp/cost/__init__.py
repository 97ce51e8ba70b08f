"""Cost model: tile kernel time, transfer time, merge time, from a GPU/network profile."""
from dcp.cost.model import CostModel, GPUProfile, load_profile, available_profiles

__all__ = ["CostModel", "GPUProfile", "load_profile", "available_profiles"]
