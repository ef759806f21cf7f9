// An rlmesh verifier in Node: serves rlmesh.reward.v1.RewardService (and grpc.health.v1.Health)
// from the stubs `npm run build` generates out of protos/rlmesh/reward/v1/reward.proto.
"use strict";

const crypto = require("node:crypto");
const fs = require("node:fs");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const { HealthImplementation } = require("grpc-health-check");
const { InvalidItem, scoreItem } = require("./verify");

let stubs;
try {
  stubs = require("./gen/rlmesh/reward/v1/reward.js");
} catch (error) {
  console.error(`generated stubs missing (${error.message}); run: npm ci && npm run build`);
  process.exit(1);
}
const { RewardServiceService } = stubs;
const SERVICE_NAME = "rlmesh.reward.v1.RewardService";
const STOP_GRACE_MS = 5000;

const { values: args } = parseArgs({
  options: {
    host: { type: "string", default: process.env.HOST || "0.0.0.0" },
    port: { type: "string", default: process.env.PORT || "50061" },
    // Comma-separated task names this verifier accepts; empty accepts every task.
    tasks: { type: "string", default: process.env.TASKS || "" },
    // A file holding the bearer token callers must present (the task's reward.remote_credential).
    "token-file": { type: "string", default: process.env.TOKEN_FILE || "" },
    // Serve anyone, with no credential: a verifier on one trusted machine only.
    insecure: { type: "boolean", default: process.env.INSECURE === "true" },
  },
});
const tasks = new Set(args.tasks.split(",").map((t) => t.trim()).filter(Boolean));

// This server is the user's, outside the mesh (docs/security.md): the trainer calls it with the
// token its task configures (reward.remote_credential), never a mesh role's secret.
let token = null;
if (!args.insecure) {
  if (!args["token-file"]) {
    console.error("no --token-file FILE (the bearer token the task's reward.remote_credential names): every call must "
      + "carry it; --insecure serves anyone");
    process.exit(2);
  }
  try {
    token = fs.readFileSync(args["token-file"], "utf8").trim();
  } catch (error) {
    console.error(`cannot read the token file ${args["token-file"]}: ${error.message}`);
    process.exit(2);
  }
  if (!token) {
    console.error(`the token file ${args["token-file"]} is empty`);
    process.exit(2);
  }
}

// A status error when the call does not carry the token, else null (compared in constant time).
function refusal(call, method) {
  if (token === null) {
    return null;
  }
  const header = call.metadata.get("authorization")[0];
  const presented = Buffer.from(typeof header === "string" && header.startsWith("Bearer ") ? header.slice("Bearer ".length) : "");
  const expected = Buffer.from(token);
  if (presented.length !== expected.length || !crypto.timingSafeEqual(presented, expected)) {
    return { code: grpc.status.UNAUTHENTICATED, details: `${method} needs a credential: \`authorization: Bearer <token>\` with this server's token` };
  }
  return null;
}

function score(call, callback) {
  const refused = refusal(call, "Score");
  if (refused !== null) {
    callback(refused);
    return;
  }
  const { task, items } = call.request;
  try {
    if (tasks.size > 0 && !tasks.has(task)) {
      throw new InvalidItem(`unknown task "${task}"; this verifier serves ${[...tasks].join(", ")}`);
    }
    callback(null, { results: items.map(scoreItem) });
  } catch (error) {
    const code = error instanceof InvalidItem ? grpc.status.INVALID_ARGUMENT : grpc.status.INTERNAL;
    callback({ code, details: error.message });
  }
}

const server = new grpc.Server();
server.addService(RewardServiceService, { score });
const health = new HealthImplementation({ "": "SERVING", [SERVICE_NAME]: "SERVING" });
health.addToServer(server);

server.bindAsync(`${args.host}:${args.port}`, grpc.ServerCredentials.createInsecure(), (error, port) => {
  if (error) {
    console.error(`cannot bind ${args.host}:${args.port}: ${error.message}`);
    process.exit(1);
  }
  // Tests and launchers wait for this exact line.
  console.log(`listening on ${port}`);
});

function stop() {
  health.setStatus("", "NOT_SERVING");
  health.setStatus(SERVICE_NAME, "NOT_SERVING");
  // Calls in flight get a grace period; a client that never finishes must not keep us alive.
  const force = setTimeout(() => {
    server.forceShutdown();
    process.exit(0);
  }, STOP_GRACE_MS);
  force.unref();
  server.tryShutdown(() => process.exit(0));
}
process.once("SIGTERM", stop);
process.once("SIGINT", stop);
