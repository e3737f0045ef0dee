"""End-to-end tests of the node: a real `python -m engine.node` process driven over its control socket.

One module per concern; the controller's ops (transitions, flush, scale, lock) in `control/`:

| module | shows | node |
|---|---|---|
| `test_identity.py` | token identity (tiny, Llama, Qwen2; inproc, tcp; 32 concurrent mixed requests), the KV moving (bytes, prompts only on prefill replicas), `corrupt_transfer` changing the output | `tiny_inproc_node`, `tiny_tcp_node`, one per checkpoint |
| `control/test_states.py` | every implemented commanded transition of architecture §6 with work in flight, illegal and ZigZag moves, `scale` to 0 and back | `tiny_tcp_node` |
| `control/test_flush.py` | Flush (MutatingToDecode adopts the queued migrations: no KV transfer), `scale` adding a replica, a draining `shutdown` | its own |
| `control/test_concurrent_scale.py` | two concurrent `scale` ops answering the same replicas (one at a time, each new replica commanded once), a scale held up past its wait answering `overloaded` | its own, in-process |
| `control/test_lock.py` | the reject-KV loop locking and unlocking, migrations avoiding a locked replica, a manual lock surviving | `tiny_tcp_node` |
| `test_bad_input.py` | every kind of bad line, an id already in flight, an oversized line | `tiny_inproc_node` |
| `test_slow_clients.py` | a client that stops reading or leaves, `cancel` while decoding, more live requests than `--max-queue` | `tiny_inproc_node` |
| `test_cancel.py` | `cancel` in the router queue, the migration queue and mid-transfer (a stalled sender) | its own |
| `test_failure.py` | `fail_replica`: `replica_failed`, `Inactive` with `last_error`, serving on; SIGTERM draining | its own |
| `test_ucx_node.py` | token identity over `--transport ucx` and `auto` | its own |

`harness.py` starts and stops nodes (exit code 0 asserted: no leaked block), `raw.py` is a plain socket for bad input, `workload.py` makes requests and
checks results against the model run in one piece, `conftest.py` holds the shared nodes and models.
Shared nodes are session-scoped and every test leaves them as it found them, so the tests also pass
one by one and spread over pytest-xdist workers.
"""
