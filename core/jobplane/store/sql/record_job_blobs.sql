-- jobplane.record_job_blobs and its triggers on jobs: a job's blob references
-- (job_blobs), recorded whoever inserts the job, the server's submit and
-- jobplane.submit_job alike (ADR-0020).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_record_job_blobs.sql; tests/integration/test_sql_files.py
-- fails while the two disagree (docs/adr/0035-sql-api-as-files.md).

CREATE OR REPLACE FUNCTION jobplane.record_job_blobs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO job_blobs (tenant_id, job_id, digest, role)
        SELECT DISTINCT NEW.tenant_id, NEW.id, substr(n #>> '{}', 7), 'input'
        FROM jsonb_path_query(
            NEW.payload,
            'strict $.** ? (@.type() == "string" && @ like_regex "^blobs/[0-9a-f]{64}$")'
        ) AS n
        ON CONFLICT DO NOTHING;
        IF NEW.payload_blob IS NOT NULL THEN
            INSERT INTO job_blobs (tenant_id, job_id, digest, role)
            VALUES (NEW.tenant_id, NEW.id, NEW.payload_blob, 'payload')
            ON CONFLICT DO NOTHING;
        END IF;
    END IF;
    IF NEW.result_blob IS NOT NULL
       AND (TG_OP = 'INSERT' OR OLD.result_blob IS DISTINCT FROM NEW.result_blob) THEN
        INSERT INTO job_blobs (tenant_id, job_id, digest, role)
        VALUES (NEW.tenant_id, NEW.id, NEW.result_blob, 'result')
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

-- Only when there can be anything to record: a payload without "blobs/" in
-- it (jsonb's text has every string whole) costs no path query.
CREATE OR REPLACE TRIGGER jobs_record_blobs_insert AFTER INSERT ON jobs
FOR EACH ROW WHEN (NEW.payload_blob IS NOT NULL OR NEW.result_blob IS NOT NULL
                   OR strpos(NEW.payload::text, 'blobs/') > 0)
EXECUTE FUNCTION jobplane.record_job_blobs();

CREATE OR REPLACE TRIGGER jobs_record_blobs_update AFTER UPDATE OF result_blob ON jobs
FOR EACH ROW WHEN (NEW.result_blob IS NOT NULL
                   AND OLD.result_blob IS DISTINCT FROM NEW.result_blob)
EXECUTE FUNCTION jobplane.record_job_blobs();
