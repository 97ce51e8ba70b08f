"""``dcp bench``: the subcommands are registered here (filled in by dcp.bench's modules)."""


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="cluster-scale benchmarks through the simulator (CSV first)")
    b.set_defaults(func=lambda args: (b.print_help(), 2)[1])
