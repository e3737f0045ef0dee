"""The in-process link: replicas of one process, copies straight between the two pools (`link`), large
rounds copied in a worker thread (`copy_lane`).
"""
