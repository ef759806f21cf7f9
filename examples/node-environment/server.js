// An rlmesh environment in Node: serves rlmesh.environment.v1.EnvironmentService (and
// grpc.health.v1.Health) from the stubs `npm run build` generates out of
// protos/rlmesh/environment/v1/environment.proto. The episodes are calculator word problems.
"use strict";

const crypto = require("node:crypto");
const fs = require("node:fs");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const { HealthImplementation } = require("grpc-health-check");
const calculator = require("./calculator");

let stubs;
try {
  stubs = require("./gen/rlmesh/environment/v1/environment.js");
} catch (error) {
  console.error(`generated stubs missing (${error.message}); run: npm ci && npm run build`);
  process.exit(1);
}
const { EnvironmentServiceService, ResetResponse, StepResponse } = stubs;
const SERVICE_NAME = "rlmesh.environment.v1.EnvironmentService";
const STOP_GRACE_MS = 5000;

const { values: args } = parseArgs({
  options: {
    host: { type: "string", default: process.env.HOST || "0.0.0.0" },
    port: { type: "string", default: process.env.PORT || "50062" },
    // A file holding the bearer token callers must present (the task's environment.remote_credential).
    "token-file": { type: "string", default: process.env.TOKEN_FILE || "" },
    // Serve anyone, with no credential: an environment on one trusted machine only.
    insecure: { type: "boolean", default: process.env.INSECURE === "true" },
  },
});

// This server is the user's, outside the mesh (docs/security.md): the trainer calls it with the
// token its task configures (environment.remote_credential), never a mesh role's secret.
let token = null;
if (!args.insecure) {
  if (!args["token-file"]) {
    console.error("no --token-file FILE (the bearer token the task's environment.remote_credential names): every call must "
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

/** A Step of an episode this server does not hold; answered with NOT_FOUND. */
class UnknownEpisode extends Error {}

// Each open episode's answer, by episode_id; Close (or a new Reset of the same id) replaces it.
const episodes = new Map();

// A unary handler that checks the caller first and turns a thrown error into a status.
function handler(method, body) {
  return (call, callback) => {
    const refused = refusal(call, method);
    if (refused !== null) {
      callback(refused);
      return;
    }
    try {
      callback(null, body(call.request));
    } catch (error) {
      if (error instanceof calculator.InvalidRow) {
        callback({ code: grpc.status.INVALID_ARGUMENT, details: error.message });
      } else if (error instanceof UnknownEpisode) {
        callback({ code: grpc.status.NOT_FOUND, details: error.message });
      } else {
        callback({ code: grpc.status.INTERNAL, details: `${method}: ${error.message}` });
      }
    }
  };
}

const service = {
  reset: handler("Reset", ({ episodeId, rowJson }) => {
    if (!episodeId) throw new calculator.InvalidRow("Reset needs an episode_id");
    const { answer, messages } = calculator.reset(rowJson);
    episodes.set(episodeId, { answer });
    return ResetResponse.fromPartial({ messages });
  }),
  step: handler("Step", ({ episodeId, text, toolCalls }) => {
    const episode = episodes.get(episodeId);
    if (episode === undefined) {
      throw new UnknownEpisode(`no episode "${episodeId}" (never reset, or closed)`);
    }
    return StepResponse.fromPartial(calculator.step(episode.answer, text, toolCalls));
  }),
  close: handler("Close", ({ episodeId }) => {
    episodes.delete(episodeId);
    return {};
  }),
};

const server = new grpc.Server();
server.addService(EnvironmentServiceService, service);
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
