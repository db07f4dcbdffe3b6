"""API key ids, last use, and scheduled revocation.

Every key gets a non-secret id (``key_`` + 16 hex digits) that operators,
logs and the CLI name it by; the secret itself is stored only as its hash.
``revoke_time`` may now lie in the future: a rotated key keeps working until
then.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# A volatile default gives every existing row an id of its own as well.
_KEY_ID_DEFAULT = "('key_' || left(replace(gen_random_uuid()::text, '-', ''), 16))"


def upgrade() -> None:
    op.execute(f"ALTER TABLE api_keys ADD COLUMN key_id text NOT NULL DEFAULT {_KEY_ID_DEFAULT}")
    op.execute("ALTER TABLE api_keys ADD CONSTRAINT api_keys_key_id_key UNIQUE (key_id)")
    op.execute("ALTER TABLE api_keys ADD COLUMN last_used_time timestamptz")
    op.execute("CREATE INDEX api_keys_tenant ON api_keys (tenant_id)")


def downgrade() -> None:
    op.execute("DROP INDEX api_keys_tenant")
    op.execute("ALTER TABLE api_keys DROP COLUMN last_used_time")
    op.execute("ALTER TABLE api_keys DROP COLUMN key_id")
