"""The pod on the network: gRPC server, index publisher, metrics, CLI, client."""
