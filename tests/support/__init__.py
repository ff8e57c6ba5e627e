"""What tests share and do not test: the local Hub server, simulated nodes, tiny models, datasets, crash scripts.

``tests`` is on sys.path (pyproject's ``pythonpath``), so a test imports ``from support.datasets import ...``.
"""
