"""What a head costs: FLOP counts, timing, replayed attention, measured latency tables, per-layer
cost tables and the knapsack that keeps the most importance under a cost limit. Below `selection/`
and `bench/`, which both read it."""
