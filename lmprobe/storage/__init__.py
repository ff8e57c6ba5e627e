"""Where a dataset's files come from: a local folder (``lmprobe.format.files.LocalFiles``), a Hub repo
(``storage.hub``), object storage through fsspec (``storage.objectstore``).

Each source implements the files protocol of ``lmprobe.format.files``; ``lmprobe.load`` picks one.
This package's modules are imported directly (``lmprobe.storage.hub``) so that reading a Hub
path never loads more than it needs; the package itself names only the URL helpers of ``storage.urls``
(standard library only), which the command line may import.
"""

from .urls import hub_path, is_hub_url, is_object_store_url, remote_of, split_url

__all__ = ["hub_path", "is_hub_url", "is_object_store_url", "remote_of", "split_url"]
