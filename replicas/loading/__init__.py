"""Weights that move, layer by layer (architecture §8): a replica's own copy of the model, from a source.

The public entry point is `replicas.loading.copy.copy_weights` (its module docstring is the guide).
Rooms: `pieces` (the checkpoint-order piece list), `split` (a loaded model's pieces as checkpoint
tensors), `builder` (a `Model` assembled piece by piece), `disk`, `host_copy`, `peer_send` /
`peer_receive` (blitz: from another replica over the transfer links), `staging` (the byte staging pool
behind each replica's `{replica}/weights` endpoint), `sources` (the host and disk sources), `memory`
(the fits-in-memory check), `progress` (what a copy reports), `tiny_checkpoint` (the built-in model as a
real safetensors checkpoint). This package imports nothing at import time, so `replicas.actor.pools` and
`replicas.weights` can use its rooms without a cycle.
"""
