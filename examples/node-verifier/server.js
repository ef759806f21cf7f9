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
    // The mesh's verifiers.json (`rlmesh secrets`): only the trainer's bearer secret is accepted.
    verifiers: { type: "string", default: process.env.VERIFIERS_FILE || "" },
    // Serve anyone, with no credential: a verifier on one trusted machine only.
    insecure: { type: "boolean", default: process.env.INSECURE === "true" },
  },
});
const tasks = new Set(args.tasks.split(",").map((t) => t.trim()).filter(Boolean));

// rlmesh authorizes every call by the caller's role (docs/security.md); Score is the trainer's.
const ALLOWED_ROLES = new Set(["trainer"]);
let roleOfDigest = null;
if (!args.insecure) {
  if (!args.verifiers) {
    console.error("no --verifiers FILE (the mesh's verifiers.json from `rlmesh secrets`): every call is authorized "
      + "by its caller's role; --insecure serves anyone");
    process.exit(2);
  }
  try {
    const table = JSON.parse(fs.readFileSync(args.verifiers, "utf8"));
    roleOfDigest = new Map(Object.entries(table).map(([role, digest]) => [digest, role]));
  } catch (error) {
    console.error(`cannot read the verifiers file ${args.verifiers}: ${error.message}`);
    process.exit(2);
  }
}

// A status error when the call's credential is missing or not an allowed role's, else null.
function refusal(call) {
  if (roleOfDigest === null) {
    return null;
  }
  const header = call.metadata.get("authorization")[0];
  if (typeof header !== "string" || !header.startsWith("Bearer ")) {
    return { code: grpc.status.UNAUTHENTICATED, details: "Score needs a credential: `authorization: Bearer <secret>` with the trainer's secret" };
  }
  const digest = crypto.createHash("sha256").update(header.slice("Bearer ".length)).digest("hex");
  const role = roleOfDigest.get(digest);
  if (role === undefined) {
    return { code: grpc.status.UNAUTHENTICATED, details: "Score needs a credential: the bearer secret presented is no role's" };
  }
  if (!ALLOWED_ROLES.has(role)) {
    return { code: grpc.status.PERMISSION_DENIED, details: `Score is not open to the ${role} role (allowed: trainer)` };
  }
  return null;
}

function score(call, callback) {
  const refused = refusal(call);
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
