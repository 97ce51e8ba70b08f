"""``dcp bench``: the simulated cluster-scale benchmarks (CSV first; figures come from ``paper_figs/``).

``dcp bench micro`` (``dcp.bench.micro``), ``dcp bench dryrun`` (``dcp.bench.dryrun``),
``dcp bench megatron`` (``dcp.bench.megatron_mock``) and ``dcp bench e2e`` (``dcp.bench.e2e``) simulate;
``dcp bench run`` (``dcp.bench.run``) runs plans for real and times them beside the simulator, and
``dcp bench calibrate`` (``dcp.bench.calibrate``) fits a cost profile to this machine.
"""


def add_bench_parser(sub) -> None:
    from dcp.bench import calibrate, dryrun, e2e, megatron_mock, micro, overhead, run

    b = sub.add_parser("bench", help="cluster-scale benchmarks through the simulator (CSV first)",
                       description=__doc__)
    b.set_defaults(func=lambda args: (b.print_help(), 2)[1])
    bsub = b.add_subparsers(dest="bench_command")
    micro.add_parser(bsub)
    dryrun.add_parser(bsub)
    megatron_mock.add_parser(bsub)
    e2e.add_parser(bsub)
    run.add_parser(bsub)
    calibrate.add_parser(bsub)
    overhead.add_parser(bsub)
