"""Figure and table scripts for the simulated benchmarks: they read only CSVs under benchmarks/results."""
