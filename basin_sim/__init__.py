"""Basin's simulator: a PD-disaggregated SGLang engine model with a prefix cache, and its workloads."""
