"""How blocks reach the Redis index: the index publisher (a pod's and an ingester's), the vLLM
event ingester (`pagekv ingest-vllm`, a process with no engine) and the ZeroMQ KV-event
stream a pod can also speak. Nothing here imports the engine."""
