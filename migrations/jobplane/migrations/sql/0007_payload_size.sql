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
