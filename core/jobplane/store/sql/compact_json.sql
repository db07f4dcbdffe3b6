-- jobplane.compact_json: a jsonb value as compact JSON: jsonb's text with the space it
-- writes after every ',' and ':' between tokens taken out. Strings are matched whole
-- first, so the spaces inside them stay.
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_compact_json.sql; tests/integration/test_sql_files.py fails
-- while the two disagree (docs/adr/0035-sql-api-as-files.md).

CREATE OR REPLACE FUNCTION jobplane.compact_json(value jsonb) RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
AS $fn$
    SELECT regexp_replace(value::text, '("(?:[^"\\]|\\.)*")| ', '\1', 'g')
$fn$
