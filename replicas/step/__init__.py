"""Plan → execute → apply: how a replica runs the model (vLLM v1's shape, nano-vllm's split).

Each role decides its next step with a pure choice over its own queue (`replicas.prefill.schedule`,
`replicas.decode.work`, `replicas.zigzag`, `replicas.encode`), the step's model call (`plan`) runs in a
worker thread, one at a time per replica (`compute`), and the result is applied in the replica's main
loop — for every role that samples tokens by one `apply_tokens`: append, stream, check the stops, free
the finished requests' blocks; a call the model refused fails its requests through one `refuse`.
"""
