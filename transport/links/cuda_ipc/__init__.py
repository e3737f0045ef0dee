"""The cuda-ipc link: GPU pools of one host shared between processes (`share`), device-to-device
copies into the receiver's pool (`link`), the closed link's write fence (`socket_fence`).
"""
