"""quants: which quant for this card and workload: fetch or make each, tune and measure it within a
disk budget, then pick."""
