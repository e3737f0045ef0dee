"""How a round's bytes are planned and copied, whatever link carries them: runs of consecutive rows
(`runs`), frames of at most `MAX_SEGMENTS` pieces (`frame_plan`), packing into host chunks and GPU
staging (`staging`), one-pass device copies (`gpu_copy`) and GPU-side bundles (`device_bundles`).

Knows no backend: links call these.
"""
