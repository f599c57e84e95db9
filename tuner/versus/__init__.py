"""`compare-models`: which model for this card and workload — planned from headers, tuned, judged head to head."""
