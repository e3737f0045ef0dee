"""The TCP link: frames on a socket (`frames`), plain non-blocking sockets under Trio (`sockets`), the
link itself (`link`).
"""
