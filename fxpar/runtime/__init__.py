"""Running per-rank programs: collectives over mesh axes, process launch."""
