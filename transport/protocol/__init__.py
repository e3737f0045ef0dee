"""The resumable transfer protocol (architecture §5), independent of any backend: the `Link` interface every
backend implements (`link`), the handshake, the status machine, progress deadlines (`liveness`),
quarantine fences, the receiver's rules (`receiver`, `landing`), the sender (`sender`, `sender_desk`).

Never imports a backend (`transport.links`); a test walks the imports and fails if it does.
"""
