-- jobplane.payload_size: a payload's size as the RPC measures it: its compact JSON, as
-- Python writes it after the trip through a protobuf Struct.
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_payload_size.sql; tests/integration/test_sql_files.py fails
-- while the two disagree (docs/adr/0035-sql-api-as-files.md).

CREATE OR REPLACE FUNCTION jobplane.payload_size(payload jsonb) RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
STRICT
AS $fn$
DECLARE
    v_text     text := payload::text;
    v_stripped text;
    v_numbers  bigint;
BEGIN
    -- jsonb's text puts a space after every ',' and ':' between tokens and
    -- nowhere else outside strings.
    v_stripped := regexp_replace(v_text, '"([^"\\]|\\.)*"', '', 'g');
    SELECT coalesce(sum(jobplane.number_length(v #>> '{}') - length(v #>> '{}')), 0)
    INTO v_numbers
    FROM jsonb_path_query(payload, 'strict $.** ? (@.type() == "number")') AS v;
    RETURN octet_length(v_text)
        - (octet_length(v_stripped) - octet_length(replace(v_stripped, ' ', '')))
        + v_numbers;
END
$fn$
