"""SAELens' activation cache, both ways (docs/saelens.md): the layout (``layout``), ``export_saelens`` and
``import_saelens``."""

from .export import ExportPlan, choose_hook, export_saelens, plan_export
from .importer import CacheInfo, import_saelens, read_cache_info
from .layout import SAELENS_CHECKED, SHARD_BYTES, TL_HOOKS, parse_tl_hook, tl_hook_name

__all__ = ["SAELENS_CHECKED", "SHARD_BYTES", "TL_HOOKS", "CacheInfo", "ExportPlan", "choose_hook", "export_saelens", "import_saelens",
           "parse_tl_hook", "plan_export", "read_cache_info", "tl_hook_name"]
