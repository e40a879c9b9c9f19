"""Basin runtime: what ships to serving (policy core, predictor loading, HTTP gateway)."""
