"""Publishing: push datasets (and what is published beside them) to the Hub, pull parts of them back.

Modules: ``commits`` (bounded, resumable, retried commits), ``push``, ``pull``, ``attachments``
(saev exports and SAE dictionaries published beside a dataset), ``dictionary`` (SAE dictionaries
pushed to a model repo of their own).
"""
