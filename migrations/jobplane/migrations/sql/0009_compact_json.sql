CREATE OR REPLACE FUNCTION jobplane.compact_json(value jsonb) RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
AS $fn$
    SELECT regexp_replace(value::text, '("(?:[^"\\]|\\.)*")| ', '\1', 'g')
$fn$
