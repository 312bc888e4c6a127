"""trainmem — the domain library of the course: number formats, loss scaling, memory
estimation and measurement, LoRA reference code, tiny models. Must not import coursekit.
"""
