-- jobplane.number_length: the length of a JSON number as Python writes it after the
-- trip through a protobuf Struct (see jobplane.payload_size).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_number_length.sql; tests/integration/test_sql_files.py fails
-- while the two disagree (docs/adr/0035-sql-api-as-files.md).
--
-- Numbers are doubles on the wire, which Python writes as an integer when whole and
-- within 2^53, otherwise in the shortest form that reads back, with an exponent below
-- 1e-4 and from 1e16 on. The shortest digits are those of the number as stored when
-- it came from such a form (or float8's shortest output, whichever is shorter: that
-- output is not always the shortest). A number outside a double's range counts as
-- stored.

CREATE OR REPLACE FUNCTION jobplane.number_length(stored text) RETURNS integer
LANGUAGE plpgsql
IMMUTABLE
STRICT
SET extra_float_digits = 1
AS $fn$
DECLARE
    v_value    numeric := stored::numeric;
    v_float    double precision;
    v_negative integer;
    v_digits   integer;
    v_exponent integer;
    v_text     text;
    v_mantissa text;
    v_int      text;
    v_frac     text;
    v_shift    integer;
    v_candidate text;
    v_pass     integer;
BEGIN
    IF v_value = 0 THEN
        RETURN 1;
    END IF;
    IF NOT (abs(v_value) > 2.4703282292062328e-324
            AND abs(v_value) < 1.797693134862315807e308) THEN
        RETURN length(stored);
    END IF;
    v_float := v_value::double precision;
    IF v_float = trunc(v_float) AND abs(v_float) <= 9007199254740992 THEN
        RETURN length(v_float::bigint::text);
    END IF;
    v_negative := (v_float < 0)::integer;
    -- The significant digits and decimal exponent of the stored text, then of
    -- float8's output; the shorter is Python's (its repr is the shortest).
    FOR v_pass IN 1..2 LOOP
        v_text := ltrim(CASE v_pass WHEN 1 THEN stored ELSE v_float::text END, '-');
        v_mantissa := split_part(v_text, 'e', 1);
        v_shift := coalesce(nullif(split_part(v_text, 'e', 2), '')::integer, 0);
        v_int := ltrim(split_part(v_mantissa, '.', 1), '0');
        v_frac := split_part(v_mantissa, '.', 2);
        IF v_int <> '' THEN
            v_candidate := rtrim(v_int || v_frac, '0');
            v_shift := v_shift + length(v_int) - 1;
        ELSE
            v_candidate := rtrim(ltrim(v_frac, '0'), '0');
            v_shift := v_shift - (length(v_frac) - length(ltrim(v_frac, '0')) + 1);
        END IF;
        IF v_pass = 1 OR length(v_candidate) < v_digits THEN
            v_digits := length(v_candidate);
            v_exponent := v_shift;
        END IF;
        -- Up to 15 digits read back as themselves: none shorter does.
        EXIT WHEN v_digits <= 15;
    END LOOP;
    IF v_exponent >= -4 AND v_exponent < 16 THEN
        IF v_exponent >= v_digits - 1 THEN
            RETURN v_negative + v_exponent + 3;  -- digits, zeros, ".0"
        ELSIF v_exponent >= 0 THEN
            RETURN v_negative + v_digits + 1;
        END IF;
        RETURN v_negative + v_digits + 1 - v_exponent;
    END IF;
    RETURN v_negative + v_digits + (v_digits > 1)::integer + 2
        + greatest(2, length(abs(v_exponent)::text));
END
$fn$
