"""The backends: one subpackage per transport (`inproc`, `tcp`, `ucx`, `cuda_ipc`), each implementing
`transport.protocol.link.Link`; `dial` reaches the optional ones (ucx, cuda-ipc) only when a link is
made, so importing zigzag needs neither ucxx nor a GPU.
"""
