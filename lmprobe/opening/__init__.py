"""``load(path)``: a dataset from a local folder, a Hub repo or object storage; the storage is picked here."""

from .load import is_datasets_folder, is_remote, load, open_hub, open_object_store

__all__ = ["is_datasets_folder", "is_remote", "load", "open_hub", "open_object_store"]
