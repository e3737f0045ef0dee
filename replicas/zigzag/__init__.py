"""ZigZag live scaling (architecture §8, seed 004): a prefill replica still receiving its weights serves.

- `wire`: the relay pool layout and the transfer of a batch's hidden states between two replicas.
- `new_prefill`: a `NewPrefill` / `RefractoryPrefill` replica — batches its queue, runs the layers it
  has, hands its oldest unfinished batch over at the layer it reached, keeps each request's KV of those
  layers until the decode replica takes it.
- `old_prefill`: an `OldPrefill` replica — asks its partners for batches, runs the remaining layers and
  the head, samples the first token, migrates its KV half beside the partner's.
- `limits`: how much work the router may hand a NewPrefill replica: its spare compute.
"""
