"""`llmserve tune`: the articles' tuning loop (change a flag, load-test again, read TTFT and throughput) done by the
product, for a workload and an SLO. A file per concept: slo (the objective's bounds), space (the flags searched),
workload (the requests), quality (the guard against modes that change the answers), objective (one candidate's
goodput by a search over the rate), search (Optuna drives the candidates), report (YAML, markdown, plots,
capacity) and cli."""
