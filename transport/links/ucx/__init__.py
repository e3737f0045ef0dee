"""The UCX link, driven from Trio: the worker and its requests (`worker`, `requests`, `library`), links
and the connect exchange (`link`, `connect`), control bodies and descriptors (`frames`), where bytes
land (`landing`, `scatter`), what is sent (`payloads`, `sends`) and the receiver's reads of the
sender's memory (`reads`, `cma`, `peer_process`).
"""
