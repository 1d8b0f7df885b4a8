"""slotscope: explain why a self-hosted llama-server felt slow.

The pipeline, one module per stage::

    sources      open files, directories, globs, stdin; .gz/.zst; tell server logs from app logs
    prefixes     strip capture-wrapper prefixes (journald, docker, ts, compose, router port)
    server_log   llama-server lines -> events -> task records + sample tables (streaming, chunked)
    app_log      the app's call records (JSONL/CSV) -> calls table
    align        server clock (seconds since process start, per session) -> wall clock
    match        calls <-> tasks by time and token counts
    analyze/     one module per question the field report asks
    output       DataFrame -> table | csv | json | parquet
    cli          the typer app, thin over the above
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataset import Dataset, load, task_view
    from .server_log import ServerLogs, read_server_logs

__all__ = ["Dataset", "ServerLogs", "load", "read_server_logs", "task_view", "__version__"]
_HOMES = {"Dataset": "dataset", "load": "dataset", "task_view": "dataset", "ServerLogs": "server_log",
          "read_server_logs": "server_log"}


def __getattr__(name: str) -> Any:
    # The library is imported when first used, not with the package: the command line's
    # `--help` and usage errors answer without pandas.
    import importlib

    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    if name == "whatif":  # `slotscope.whatif.run(ds, settings)` after `import slotscope`
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
