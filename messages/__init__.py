"""Every msgspec Struct that crosses a task, process or socket boundary, and the codecs.

No logic beyond validation lives here (architecture §2, §3).
"""
