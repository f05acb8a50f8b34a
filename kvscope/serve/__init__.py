"""Front ends that drive the engine: the workload driver, the HTTP API, metrics and exporters."""
