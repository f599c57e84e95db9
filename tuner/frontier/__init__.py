"""frontier: the multi-objective study over context, slots and KV quality, answered by its Pareto front."""
