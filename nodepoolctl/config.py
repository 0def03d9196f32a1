"""Where nodepoolctl finds the API and its token.

Precedence (first wins): ``--url`` / ``--token`` options, the environment (``NODEPOOL_URL``,
``NODEPOOL_TOKEN``), then the config file: ``$NODEPOOLCTL_CONFIG``, else
``$XDG_CONFIG_HOME/nodepool/config.toml`` (``~/.config/nodepool/config.toml``). The default file
may be absent; a file named by ``NODEPOOLCTL_CONFIG`` must exist::

    url = "http://127.0.0.1:8000"
    token = "0123456789abcdef..."
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


class ConfigError(Exception):
    """The config file cannot be read or has the wrong shape; the message says which and why."""


@dataclass(frozen=True)
class Config:
    url: str
    token: str | None
    source: str


def config_path() -> Path:
    if os.environ.get("NODEPOOLCTL_CONFIG"):
        return Path(os.environ["NODEPOOLCTL_CONFIG"])
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "nodepool" / "config.toml"


def _file_values(path: Path, *, named: bool) -> dict:
    if not path.exists():
        if named:
            # Named on purpose: reading no file would quietly talk to another server (or none).
            raise ConfigError(f"{path}: no such config file (named by NODEPOOLCTL_CONFIG)")
        return {}
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    for key in ("url", "token"):
        if key in values and not isinstance(values[key], str):
            raise ConfigError(f"{path}: {key} must be a string")
    return values


def load_config(*, url: str | None = None, token: str | None = None) -> Config:
    """The effective configuration; see the module docstring for the precedence.

    Raises:
        ConfigError: the config file exists but is not valid TOML of the right shape, or the file
            that ``NODEPOOLCTL_CONFIG`` names does not exist (the default file may be absent).
    """
    path = config_path()
    values = _file_values(path, named=bool(os.environ.get("NODEPOOLCTL_CONFIG")))
    final_url = url or os.environ.get("NODEPOOL_URL") or values.get("url") or DEFAULT_URL
    final_token = token or os.environ.get("NODEPOOL_TOKEN") or values.get("token")
    return Config(url=final_url.rstrip("/"), token=final_token, source=str(path) if values else "environment")
