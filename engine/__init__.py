"""The node, control server, router, controller, client, log analysis and benchmarks."""
