"""The warehouse's files as tests see them, on either stack: a local directory (the default
tier) or S3 (the cluster tier's S3Proxy). Objects are named by their location without the
scheme (``/abs/path`` locally, ``bucket/key`` on S3), so the files a listing finds and the
``file_path`` values Iceberg's metadata holds compare equal."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from backfill_assets.stack.settings import Settings

_S3 = ("s3", "s3a", "s3n")


def object_name(uri: str) -> str:
    """``uri`` without its scheme: ``s3://b/k`` -> ``b/k``, ``file:///p`` or ``/p`` -> ``/p``."""
    parsed = urlparse(uri)
    if parsed.scheme in _S3:
        return f"{parsed.netloc}{parsed.path}"
    return parsed.path


def _filesystem(settings: Settings, uri: str) -> pafs.FileSystem:
    import pyarrow.fs as pafs

    from backfill_assets.stack import catalog

    if urlparse(uri).scheme in _S3:
        return catalog.s3_filesystem(settings.catalog)
    return pafs.LocalFileSystem()


def parquet_files(settings: Settings, uri: str) -> set[str]:
    """Every ``*.parquet`` object under ``uri`` (a table's data prefix), as :func:`object_name`
    names it, whether or not a snapshot references it."""
    import pyarrow.fs as pafs

    fs = _filesystem(settings, uri)
    selector = pafs.FileSelector(object_name(uri), recursive=True, allow_not_found=True)
    return {
        info.path
        for info in fs.get_file_info(selector)
        if info.type == pafs.FileType.File and info.path.endswith(".parquet")
    }
