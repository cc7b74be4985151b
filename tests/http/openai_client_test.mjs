// The HTTP API driven by OpenAI's official Node client (npm `openai`, installed into
// tests/http/node_modules by scripts/setup.sh): a real subspace-server on free ports, with a
// ChatML template and bearer tokens, answers models, chat and completions (whole and streamed),
// errors as the client's typed exceptions, a session that reuses its cache, and a stream the
// client aborts, whose request the server cancels. The long-context model (context 2,048, ~1 ms a
// token here) makes the aborted request long enough that only a cancellation can end it early.
//
//   node tests/http/openai_client_test.mjs --server-bin B --model M.gguf --chat-template T.jinja
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { parseArgs } from "node:util";

let OpenAI;
try {
  ({ default: OpenAI } = await import("openai"));
} catch (e) {
  console.error("openai_client_test: the npm package 'openai' is missing; run scripts/setup.sh");
  process.exit(1);
}

const { values: args } = parseArgs({
  options: {
    "server-bin": { type: "string" },
    model: { type: "string" },
    "chat-template": { type: "string" },
  },
});

const TOKEN = "subspace-test-token-0123456789";
let server;
let baseURL;
let client;

function startServer() {
  const dir = mkdtempSync(join(tmpdir(), "subspace-http-"));
  const tokens = join(dir, "tokens");
  writeFileSync(tokens, `${TOKEN}\n`);
  const proc = spawn(args["server-bin"], [
    "--model", args.model, "--chat-template", args["chat-template"], "--host", "127.0.0.1",
    "--port", "0", "--http-port", "0", "--metrics-port", "-1", "--auth-tokens", tokens,
    "--log-level", "warn",
  ], { stdio: ["ignore", "pipe", "inherit"] });
  return new Promise((resolve, reject) => {
    let out = "";
    proc.on("exit", (code) => reject(new Error(`subspace-server exited with ${code}`)));
    proc.stdout.on("data", (data) => {
      out += data;
      const m = /http port (\d+)/.exec(out);
      if (m) resolve({ proc, port: Number(m[1]) });
    });
  });
}

before(async () => {
  const started = await startServer();
  server = started.proc;
  baseURL = `http://127.0.0.1:${started.port}/v1`;
  client = new OpenAI({ apiKey: TOKEN, baseURL, maxRetries: 0, timeout: 60_000 });
});

after(() => {
  server.removeAllListeners("exit");
  server.kill("SIGTERM");
});

async function metric(series) {
  const res = await fetch(baseURL.replace("/v1", "/metrics"));
  const body = await res.text();
  const line = body.split("\n").find((l) => l.startsWith(series + " "));
  return line ? Number(line.split(" ")[1]) : 0;
}

const MESSAGES = [
  { role: "system", content: "You are a storyteller." },
  { role: "user", content: "Once upon a time" },
];

test("models.list names the model requests use", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.equal(ids.length, 1);
  const model = await client.models.retrieve(ids[0]);
  assert.equal(model.id, ids[0]);
  assert.equal(model.object, "model");
});

test("chat completion: greedy, deterministic, with usage and logprobs", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  const request = { model, messages: MESSAGES, max_tokens: 12, temperature: 0, ignore_eos: true };
  const a = await client.chat.completions.create({ ...request, logprobs: true, top_logprobs: 3 });
  const b = await client.chat.completions.create(request);
  assert.equal(a.object, "chat.completion");
  assert.equal(a.choices.length, 1);
  assert.equal(a.choices[0].message.role, "assistant");
  assert.ok(a.choices[0].message.content.length > 0);
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.equal(a.choices[0].finish_reason, "length");
  assert.equal(a.usage.completion_tokens, 12);
  assert.ok(a.usage.prompt_tokens > 0);
  assert.equal(a.usage.total_tokens, a.usage.prompt_tokens + 12);
  const lp = a.choices[0].logprobs.content;
  assert.equal(lp.length, 12);
  for (const t of lp) {
    assert.ok(t.logprob <= 0);
    assert.equal(t.top_logprobs.length, 3);
    // Greedy: the chosen token is the most likely one.
    assert.ok(t.top_logprobs[0].logprob <= t.logprob + 1e-5);
  }
  assert.equal(b.choices[0].logprobs, null);
});

test("streamed chat equals the whole answer and ends with usage", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  const request = { model, messages: MESSAGES, max_tokens: 12, temperature: 0, ignore_eos: true };
  const whole = await client.chat.completions.create(request);
  const stream = await client.chat.completions.create({
    ...request, stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  let roles = 0;
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "chat.completion.chunk");
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.role) roles += 1;
      if (choice.delta.content) text += choice.delta.content;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  assert.equal(roles, 1);
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 12);
});

test("completions: text and streamed text agree; stop sequences end the answer", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  const request = { model, prompt: "The king said", max_tokens: 10, temperature: 0 };
  const whole = await client.completions.create({ ...request, logprobs: 2 });
  assert.equal(whole.object, "text_completion");
  assert.equal(whole.choices[0].logprobs.tokens.length, whole.usage.completion_tokens);
  let text = "";
  for await (const chunk of await client.completions.create({ ...request, stream: true })) {
    text += chunk.choices[0]?.text ?? "";
  }
  assert.equal(text, whole.choices[0].text);
  const words = whole.choices[0].text.trim().split(/\s+/);
  if (words.length > 1) {
    const stopped = await client.completions.create({ ...request, stop: [words[1]] });
    assert.equal(stopped.choices[0].finish_reason, "stop");
    assert.ok(!stopped.choices[0].text.includes(words[1]));
  }
});

test("errors arrive as the client's typed exceptions", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  await assert.rejects(
    client.chat.completions.create({ model, messages: MESSAGES, temperature: -1 }),
    (e) => e instanceof OpenAI.BadRequestError && /temperature/.test(e.message));
  await assert.rejects(
    client.chat.completions.create({ model: "gpt-nothing", messages: MESSAGES }),
    (e) => e instanceof OpenAI.NotFoundError && /gpt-nothing/.test(e.message));
  await assert.rejects(
    client.chat.completions.create({ model, messages: MESSAGES, n: 2 }),
    (e) => e instanceof OpenAI.BadRequestError && /\bn\b/.test(e.message));
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: "wizard", content: "x" }] }),
    (e) => e instanceof OpenAI.BadRequestError && /role/.test(e.message));
  const stranger = new OpenAI({ apiKey: "not-a-token-of-this-server", baseURL, maxRetries: 0 });
  await assert.rejects(stranger.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
  await assert.rejects(
    client.chat.completions.create({ model, messages: MESSAGES, session_id: "no-such-session" }),
    (e) => e instanceof OpenAI.NotFoundError);
});

test("a session keeps its cache between turns", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  const session = await client.post("/sessions", { body: { ttl_seconds: 60 } });
  assert.equal(session.object, "session");
  const turn1 = await client.chat.completions.create({
    model, messages: MESSAGES, max_tokens: 8, temperature: 0, session_id: session.id,
  });
  assert.equal(turn1.session_id, session.id);
  const messages = [
    ...MESSAGES,
    { role: "assistant", content: turn1.choices[0].message.content },
    { role: "user", content: "And then?" },
  ];
  const turn2 = await client.chat.completions.create({
    model, messages, max_tokens: 8, temperature: 0, session_id: session.id,
  });
  // The conversation's first turn was not prefilled again.
  assert.ok(turn2.usage.prompt_tokens_details.cached_tokens >= turn1.usage.prompt_tokens,
            JSON.stringify(turn2.usage));
  const info = await client.get(`/sessions/${session.id}`);
  assert.ok(info.tokens > turn1.usage.prompt_tokens);
  assert.equal(info.cache_location, "pool");
  await client.delete(`/sessions/${session.id}`);
  await assert.rejects(client.get(`/sessions/${session.id}`),
                       (e) => e instanceof OpenAI.NotFoundError);
});

test("without a session, a resent conversation reuses the kept cache", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  const request = { model, max_tokens: 8, temperature: 0, ignore_eos: true };
  const turn1 = await client.chat.completions.create({ ...request, messages: MESSAGES });
  const messages = [
    ...MESSAGES,
    { role: "assistant", content: turn1.choices[0].message.content },
    { role: "user", content: "And then what happened?" },
  ];
  const turn2 = await client.chat.completions.create({ ...request, messages });
  // The server kept turn 1's cache (--prompt-cache-entries): only the new turn is prefilled.
  const cached = turn2.usage.prompt_tokens_details.cached_tokens;
  assert.ok(cached >= turn1.usage.prompt_tokens, JSON.stringify(turn2.usage));
  assert.ok(cached < turn2.usage.prompt_tokens, JSON.stringify(turn2.usage));
});

test("a client that aborts a stream gets its request cancelled", async () => {
  const [{ id: model }] = (await client.models.list()).data;
  const series = 'subspace_requests_total{finish_reason="cancelled",status="CANCELLED"}';
  const before = await metric(series);
  const controller = new AbortController();
  const stream = await client.chat.completions.create(
    { model, messages: MESSAGES, max_tokens: 1500, ignore_eos: true, stream: true },
    { signal: controller.signal });
  let chunks = 0;
  try {
    for await (const chunk of stream) {
      if (chunk.choices[0]?.delta?.content && ++chunks === 2) controller.abort();
    }
  } catch (e) {
    // The client either ends the iteration quietly or throws its abort error.
    assert.ok(e instanceof OpenAI.APIUserAbortError || e.name === "AbortError", String(e));
  }
  assert.ok(chunks < 1500);
  const deadline = Date.now() + 10_000;
  while ((await metric(series)) === before && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.equal(await metric(series), before + 1);
  assert.equal(await metric("subspace_requests_running"), 0);
});
