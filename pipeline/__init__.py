"""Basin's offline pipeline: trajectories -> session table -> features -> ridge -> ONNX -> evaluation."""
