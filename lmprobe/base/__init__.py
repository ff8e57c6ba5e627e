"""The base layer: what every other layer uses (paths, atomic writes, retries, units, hashing, locks,
progress, display). It imports nothing of lmprobe but ``lmprobe.errors`` and ``lmprobe.version``."""
