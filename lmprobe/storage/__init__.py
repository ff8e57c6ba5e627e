"""Where a dataset's files come from: a local folder (``lmprobe.format.files.LocalFiles``), a Hub repo
(``storage.hub``), object storage through fsspec (``storage.objectstore``).

Each source implements the files protocol of ``lmprobe.format.files``; ``lmprobe.load`` picks one.
This package's modules are imported directly (``lmprobe.storage.hub``) so that reading a Hub
path never loads more than it needs.
"""
