"""How big each speculative step is: budgets, policies, the drafter's gate, calibration, the latency model."""
