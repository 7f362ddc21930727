// The official openai Node SDK against a running Berth gateway, with only
// baseURL changed. Run by tests/e2e/test_node_sdk.py: BERTH_BASE_URL,
// BERTH_KEY (org A) and BERTH_OTHER_KEY (org B) come from the test. Each
// check that fails throws; the last line printed is a JSON report of what
// the calls returned, which the test asserts on.
import assert from "node:assert/strict";
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.BERTH_BASE_URL, apiKey: process.env.BERTH_KEY, maxRetries: 0, timeout: 60_000 });
const other = new OpenAI({ baseURL: process.env.BERTH_BASE_URL, apiKey: process.env.BERTH_OTHER_KEY, maxRetries: 0, timeout: 60_000 });
const sessions = client.beta.agents.sessions;
const report = {};

async function collect(iterable) {
  const out = [];
  for await (const value of iterable) out.push(value);
  return out;
}

async function statusOf(promise) {
  try {
    await promise;
    return { status: 200 };
  } catch (error) {
    if (!(error instanceof OpenAI.APIError)) throw error;
    return { status: error.status, code: error.code ?? null, param: error.param ?? null, type: error.type ?? null };
  }
}

// 1. A streamed creation: the SDK's collector ends at the turn's idle and gives its result.
const lookup = {
  type: "function",
  name: "lookup",
  description: "Looks a value up.",
  parameters: { type: "object", properties: { key: { type: "string" } }, required: ["key"] },
};
const created = await sessions.create({
  agent: { model: "scripted", instructions: "be brief", tools: [lookup] },
  environment: { type: "openai_hosted" },
  input: "$ echo node-hi\nall done from node",
  metadata: { sdk: "node" },
  stream: true,
});
const result = await created.finalResult();
report.create_stream = { turn_status: result.turn.status, output_text: result.output_text, session_id: result.session_id };

// 2. The session as retrieved, listed and paged.
const session = await sessions.retrieve(result.session_id);
report.session = { status: session.status, object: session.object, metadata: session.metadata, spend_control: session.spend_control, environment_status: session.environment?.status ?? null };
const listed = await collect(sessions.list({ limit: 1 }));
report.listed_ids = listed.map((s) => s.id);
const items = await collect(sessions.items.list(session.id, { order: "asc" }));
const command = items.find((i) => i.type === "command_execution");
report.items = { types: items.map((i) => i.type), command_output: command?.output ?? command?.aggregated_output ?? null, command };
const turns = await collect(sessions.turns.list(session.id));
report.turns = turns.map((t) => ({ status: t.status, object: t.object }));

// 3. sessions.stream: input on an idle session, an application function answered by a handler.
const seen = [];
const stream = sessions.stream(session.id, {
  input: 'call lookup {"key": "k"}\nthe value came back',
  toolHandlers: {
    lookup: (args) => {
      seen.push(args);
      return { value: 3 };
    },
  },
}).withResultCollection();
const types = [];
for await (const event of stream) types.push(event.type);
const streamed = await stream.finalResult();
report.stream = { handler_args: seen, turn_status: streamed.turn.status, output_text: streamed.output_text, saw_requires_action: types.includes("agent.session.requires_action"), last: types.at(-1) };

// 4. Update, then a raw event stream from the start of the log.
const updated = await sessions.update(session.id, { metadata: { sdk: "node", step: "4" }, spend_control: { limit: 1000 } });
report.updated = { metadata: updated.metadata, limit: updated.spend_control.limit };
const log = await sessions.events.stream(session.id, { headers: { "Last-Event-ID": "0" } });
const logged = [];
for await (const event of log) {
  logged.push(event.type);
  if (logged.filter((t) => t === "agent.session.turn.completed").length === 2) break;
}
report.log_head = logged.slice(0, 3);

// 5. Environments and vaults.
const environment = await client.beta.agents.environments.create({ environment: { type: "openai_hosted" } });
const attached = await sessions.create({ agent: { model: "scripted" }, environment: { type: "openai_hosted", environment_id: environment.id } });
report.environment = { id_prefix: environment.id.split("_")[0], attached_environment: attached.environment?.id === environment.id };
const vault = await client.beta.agents.vaults.create({ name: "node" });
const vaults = await collect(client.beta.agents.vaults.list());
report.vault = { listed: vaults.some((v) => v.id === vault.id), deleted: (await client.beta.agents.vaults.delete(vault.id)).deleted };

// 6. Errors: the SDK's error classes, with the OpenAI envelope's fields.
report.errors = {
  missing: await statusOf(sessions.retrieve("sess_doesnotexist")),
  other_org: await statusOf(other.beta.agents.sessions.retrieve(session.id)),
  bad_input: await statusOf(sessions.create({ agent: { model: "scripted" }, environment: { type: "openai_hosted" }, review: "sometimes" })),
};
assert.equal((await statusOf(sessions.retrieve("sess_doesnotexist"))).status, 404);

// 7. Deletion.
const deleted = await sessions.delete(attached.id);
report.deleted = { deleted: deleted.deleted, id: deleted.id === attached.id, after: (await statusOf(sessions.retrieve(attached.id))).status };

console.log(JSON.stringify(report));
