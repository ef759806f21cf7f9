"""An agent harness with nothing but Python's standard library: three chat turns against its episode's
session on the rlmesh gateway (the increment problem of its dataset row, then two requests to check
the answer), each sending the whole conversation back as it was returned; then its reward, the
share of the answer's digits the last reply got right, POSTed to the gateway."""

import http.client
import json
import os
import sys
import urllib.parse

FOLLOW_UPS = ("Check it once more.", "Give the final answer.")


def chat(connection: http.client.HTTPConnection, path: str, headers: dict, messages: list) -> dict:
    connection.request(
        "POST",
        path + "/chat/completions",
        json.dumps({"model": "policy", "messages": messages, "max_tokens": 12}),
        headers,
    )
    reply = connection.getresponse()
    body = json.loads(reply.read())
    if reply.status != 200:
        sys.exit(f"the gateway answered {reply.status}: {body}")
    return body["choices"][0]["message"]


def share_right(reply: str, answer: str) -> float:
    digits = "".join(c for c in reply if c.isdigit())
    return sum(1 for got, want in zip(digits, answer) if got == want) / max(len(digits), len(answer), 1)


def main() -> None:
    base = urllib.parse.urlparse(os.environ["OPENAI_BASE_URL"])
    if "RLMESH_ROW_FILE" in os.environ:
        with open(os.environ["RLMESH_ROW_FILE"]) as row_file:
            row = json.load(row_file)
    else:
        row = json.loads(os.environ["RLMESH_ROW"])
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
    connection = http.client.HTTPConnection(base.hostname, base.port, timeout=300)
    messages = [{"role": "user", "content": row["prompt"]}]
    for follow_up in (*FOLLOW_UPS, None):
        messages.append(chat(connection, base.path, headers, messages))
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    reward = share_right(messages[-1].get("content") or "", row["answer"])
    connection.request("POST", base.path + "/rlmesh/reward", json.dumps({"reward": reward}), headers)
    reply = connection.getresponse()
    if reply.status != 200:
        sys.exit(f"the reward was refused: {reply.status} {reply.read()!r}")
    print(json.dumps({"turns": len(FOLLOW_UPS) + 1, "reward": reward}))


if __name__ == "__main__":
    main()
