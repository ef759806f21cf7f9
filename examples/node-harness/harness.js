// An rlmesh agent harness in Node: a black box that holds a short conversation with the policy
// through the official `openai` package, then reports its reward. The rlmesh gateway runs it once
// per episode with OPENAI_BASE_URL (http://host:port/sessions/<id>/v1) and OPENAI_API_KEY (that
// session's key) in its environment; every call it makes becomes a turn of the episode.
"use strict";

const { APIError, OpenAI } = require("openai");

const SYSTEM = "You are a counter. Answer briefly.";
const MODEL = "policy";
const MAX_TOKENS = 16;

/** A failure whose message says it all (a missing setting, a refused reward): no stack trace. */
class HarnessError extends Error {}

function setting(name, fallback) {
  const value = process.env[name];
  if (value === undefined || value === "") {
    if (fallback === undefined) throw new HarnessError(`${name} is not set (the rlmesh gateway sets it for each episode)`);
    return fallback;
  }
  return value;
}

// What the user says at turn `turn` (1-based): the task, then two follow-ups; later turns repeat the last.
function userText(turn, task) {
  return turn === 1 ? task : turn === 2 ? "Again, shorter." : "Once more.";
}

// One turn without streaming: the assistant message exactly as returned goes back into the history.
async function plainTurn(client, messages) {
  const response = await client.chat.completions.create({ model: MODEL, messages, max_tokens: MAX_TOKENS });
  const choice = response.choices[0];
  if (choice === undefined) throw new HarnessError(`the response has no choices: ${JSON.stringify(response)}`);
  return { message: choice.message, content: choice.message.content ?? "", finishReason: choice.finish_reason, rlmesh: response.rlmesh };
}

// One streamed turn: the content is the deltas' concatenation; the gateway's `rlmesh` field rides on
// the chunk that carries the finish reason.
async function streamedTurn(client, messages) {
  const stream = await client.chat.completions.create({ model: MODEL, messages, max_tokens: MAX_TOKENS, stream: true });
  let content = "";
  let finishReason = null;
  let rlmesh;
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (choice === undefined) continue;
    content += choice.delta?.content ?? "";
    if (choice.finish_reason) {
      finishReason = choice.finish_reason;
      rlmesh = chunk.rlmesh;
    }
  }
  if (finishReason === null) throw new HarnessError("the stream ended without a finish_reason");
  return { message: { role: "assistant", content }, content, finishReason, rlmesh };
}

async function reportReward(baseURL, apiKey, reward) {
  const response = await fetch(`${baseURL.replace(/\/+$/, "")}/rlmesh/reward`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify({ reward }),
  });
  if (!response.ok) {
    throw new HarnessError(`POST /rlmesh/reward answered ${response.status}: ${(await response.text()).slice(0, 500)}`);
  }
}

async function main() {
  const baseURL = setting("OPENAI_BASE_URL");
  const apiKey = setting("OPENAI_API_KEY");
  const task = setting("HARNESS_TASK", "Count to three.");
  const turns = Number(setting("HARNESS_TURNS", "3"));
  if (!Number.isInteger(turns) || turns < 1) throw new HarnessError(`HARNESS_TURNS must be a positive integer, got ${process.env.HARNESS_TURNS}`);

  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
  const messages = [{ role: "system", content: SYSTEM }];
  const records = [];
  for (let turn = 1; turn <= turns; turn++) {
    messages.push({ role: "user", content: userText(turn, task) });
    const result = turn >= 3 ? await streamedTurn(client, messages) : await plainTurn(client, messages);
    messages.push(result.message);
    records.push({ turn, content: result.content, finish_reason: result.finishReason, rlmesh: result.rlmesh ?? null });
  }
  const reward = records.filter((r) => r.content !== "").length / turns;
  await reportReward(baseURL, apiKey, reward);
  return JSON.stringify({ turns: records, reward });
}

main().then(
  // Exit once the line is written: the client's keep-alive connections must not hold the process.
  (line) => process.stdout.write(`${line}\n`, () => process.exit(0)),
  (error) => {
    console.error(`harness failed: ${error instanceof APIError || error instanceof HarnessError ? error.message : error?.stack ?? error}`);
    process.exit(1);
  },
);
