// An idempotent consumer of jobplane domain events, in Node (see docs/events.md).
//
// The inbox pattern: for each delivery, one transaction inserts the event id
// into jobplane_inbox and makes the service's own writes; the message is
// acked only after that commit. A redelivered copy finds its inbox row and is
// acked without being applied again.
//
// Settings (environment): AMQP_URL, DATABASE_URL, CONSUMER (the queue's name
// and the inbox key), PATTERNS (comma-separated, e.g. "job.*,artifact.#"),
// EXCHANGE (default jobplane.events), DELIVERY_LIMIT (default 5).
//
// Lifecycle events (job.queued, job.failed, ...) reach the exchange only for
// the types the deployment's topology declares; for "job.*" to receive them:
//   [events]
//   publish_lifecycle = ["job.#"]
// then `jobplane topology apply` (docs/events.md).
import amqp from "amqplib";
import pg from "pg";

const env = process.env;
const CONSUMER = env.CONSUMER ?? "example-node";
const EXCHANGE = env.EXCHANGE ?? "jobplane.events";
const PATTERNS = (env.PATTERNS ?? "#").split(",").filter(Boolean);
const DELIVERY_LIMIT = Number(env.DELIVERY_LIMIT ?? 5);
const DEAD_LETTERS = `${CONSUMER}.dead`;

const SCHEMA = `
  CREATE TABLE IF NOT EXISTS jobplane_inbox (
      consumer    text        NOT NULL,
      event_id    uuid        NOT NULL,
      event_type  text        NOT NULL,
      received_at timestamptz NOT NULL DEFAULT now(),
      PRIMARY KEY (consumer, event_id)
  );
  CREATE TABLE IF NOT EXISTS event_log (
      event_id   uuid  NOT NULL,
      event_type text  NOT NULL,
      payload    jsonb NOT NULL
  );`;

// The envelope, version 1: refuse anything else rather than guess.
function decode(body) {
  const event = JSON.parse(body.toString("utf8"));
  if (event === null || typeof event !== "object" || event.v !== 1) {
    throw new Error("not a version 1 event envelope");
  }
  for (const key of ["event_id", "event_type", "timestamp", "tenant_id", "correlation_id"]) {
    if (typeof event[key] !== "string" || event[key] === "") throw new Error(`bad ${key}`);
  }
  if (event.payload === null || typeof event.payload !== "object" || Array.isArray(event.payload)) {
    throw new Error("bad payload");
  }
  return event;
}

// The service's own writes: here, a log of the events it saw.
async function apply(client, event) {
  await client.query(
    "INSERT INTO event_log (event_id, event_type, payload) VALUES ($1, $2, $3)",
    [event.event_id, event.event_type, event.payload],
  );
}

const pool = new pg.Pool({ connectionString: env.DATABASE_URL, max: 4 });
await pool.query(SCHEMA);

const connection = await amqp.connect(env.AMQP_URL);
const channel = await connection.createChannel();
await channel.prefetch(1);
await channel.assertExchange(EXCHANGE, "topic", { durable: true });
await channel.assertQueue(DEAD_LETTERS, { durable: true, arguments: { "x-queue-type": "quorum" } });
await channel.assertQueue(CONSUMER, {
  durable: true,
  arguments: {
    "x-queue-type": "quorum",
    "x-delivery-limit": DELIVERY_LIMIT,
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": DEAD_LETTERS,
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
  },
});
for (const pattern of PATTERNS) await channel.bindQueue(CONSUMER, EXCHANGE, pattern);

await channel.consume(CONSUMER, async (message) => {
  if (message === null) return; // the broker cancelled the consumer
  let event;
  try {
    event = decode(message.content);
  } catch (error) {
    console.error(JSON.stringify({ event: "event.message.rejected", reason: String(error) }));
    channel.reject(message, false); // to the dead-letter queue
    return;
  }
  const client = await pool.connect();
  let applied;
  try {
    await client.query("BEGIN");
    const inbox = await client.query(
      `INSERT INTO jobplane_inbox (consumer, event_id, event_type) VALUES ($1, $2, $3)
       ON CONFLICT (consumer, event_id) DO NOTHING RETURNING 1`,
      [CONSUMER, event.event_id, event.event_type],
    );
    applied = inbox.rowCount === 1;
    if (applied) await apply(client, event);
    await client.query("COMMIT");
  } catch (error) {
    await client.query("ROLLBACK").catch(() => {});
    console.error(JSON.stringify({ event: "event.handler.failed", error: String(error) }));
    channel.nack(message, false, true); // again later; dead-lettered after the limit
    return;
  } finally {
    client.release();
  }
  channel.ack(message); // only after the commit
  console.log(JSON.stringify({ event: applied ? "event.applied" : "event.duplicate",
                               event_id: event.event_id, event_type: event.event_type }));
}, { noAck: false });

console.log(JSON.stringify({ event: "events.consumer.started", consumer: CONSUMER, patterns: PATTERNS }));

for (const signal of ["SIGINT", "SIGTERM"]) {
  process.on(signal, async () => {
    await channel.close().catch(() => {});
    await connection.close().catch(() => {});
    await pool.end();
    process.exit(0);
  });
}
