"""Alembic's view of jobplane's migrations, for the tests of one migration."""

from __future__ import annotations

from importlib import resources

from alembic.config import Config
from alembic.script import ScriptDirectory


def alembic_config(url: str = "") -> Config:
    """Alembic's configuration for jobplane's migrations on ``url``."""
    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def revision_before(revision: str) -> str:
    """The revision ``revision`` follows, whichever that is in the chain."""
    script = ScriptDirectory.from_config(alembic_config()).get_revision(revision)
    assert script is not None and isinstance(script.down_revision, str)
    return script.down_revision
