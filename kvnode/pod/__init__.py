"""The pod on the network: gRPC server, its flags, messages, metrics, the KV transfer service, client."""
